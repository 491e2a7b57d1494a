"""One Colossal-AI layer class against the plain torch layer on the whole tensors, on every rank.

`compare(name, make, make_plain, x, x_cut, y_cut)` builds both from the same seed, checks that
every parameter starts as the plain one's slice (initializers included), feeds my block of x
(`x_cut`, a tensor/base.py layout) and checks that the output, the input gradient and every
parameter's gradient are the plain ones' blocks; `compare_loss` does the same for a loss on my
block of the logits. The initializers put the fans they were given into their numbers, so a
layer passing the wrong fans is caught. test_colossal_layers.py (1d, 2d) and layer_checks.py
(2.5d, 3d) run them."""
import torch
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

from nanocolossal.tensor.base import slice_of

B, S, D, V, PAD = 4, 3, 8, 16, 5
COL = [(-1, "tensor")]                       # 1d: last dimension split
ACT = [(0, "row"), (-1, "col")]              # 2d: batch by grid row, last dim by grid column
ROWS = [(0, "row")]                          # 2d: this grid row's samples


def w_init(tensor, fan_in, fan_out):
    """A Colossal-AI-style initializer whose numbers show the fans it was given."""
    return nn.init.normal_(tensor, mean=1.0 / fan_out, std=1.0 / fan_in)


def b_init(tensor, fan_in, fan_out=None):
    return nn.init.uniform_(tensor, fan_in, fan_in + 1.0)


def pos_init(tensor, fan_in=None, fan_out=None):
    return nn.init.uniform_(tensor, -3.0, 3.0)


def inited(plain, weight=None, bias=None):
    """The plain layer initialised as the Colossal-AI layer is asked to (fans as dicts)."""
    with torch.no_grad():
        if weight is not None:
            w_init(plain.weight, **weight)
        if bias is not None:
            b_init(plain.bias, **bias)
    return plain


def pad_embedding(vocab=V):
    plain = inited(nn.Embedding(vocab, D, padding_idx=PAD), {"fan_in": vocab, "fan_out": D})
    with torch.no_grad():
        plain.weight[PAD].zero_()
    return plain


def tied_plain(embedding, classifier_bias_fans):
    classifier = nn.Linear(D, V)
    classifier.weight = embedding.weight
    return nn.Sequential(embedding, inited(classifier, bias=classifier_bias_fans))


def data(kind, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    if kind == "ids":
        ids = torch.randint(0, V, (B, S), generator=g)
        ids[0, 0] = PAD  # the padding row is looked up, and must get no gradient
        return ids
    shape = {"flat": (B, D), "seq": (B, S, D), "wide": (B, 2 * D), "images": (B, 3, 4, 4)}[kind]
    return torch.randn(*shape, generator=g, dtype=dtype)


def compare(name, make, make_plain, x, x_cut, y_cut, call=None):
    """Forward and backward of `make()` on my block of x against `make_plain()` on all of x."""
    torch.manual_seed(0)
    layer = make()
    torch.manual_seed(0)
    plain = make_plain()
    mine_params = dict(layer.named_parameters())
    assert mine_params.keys() == dict(plain.named_parameters()).keys(), name
    for key, p in mine_params.items():
        whole = plain.get_parameter(key)
        assert p.dtype == whole.dtype, f"{name}: {key} dtype"
        assert torch.equal(p.detach(), slice_of(whole.detach(), p.tensor_splits)), f"{name}: {key}"
    grads = x.is_floating_point()
    mine_x = slice_of(x, x_cut).clone().requires_grad_(grads)
    whole_x = x.clone().requires_grad_(grads)
    y = call(layer, mine_x) if call else layer(mine_x)
    whole_y = plain(whole_x)
    assert_close(y, slice_of(whole_y, y_cut), msg=lambda m: f"{name}: {m}")
    upstream = torch.linspace(-1.0, 1.0, whole_y.numel(), dtype=whole_y.dtype)
    upstream = upstream.reshape(whole_y.shape)
    (y * slice_of(upstream, y_cut)).sum().backward()
    (whole_y * upstream).sum().backward()
    if grads:
        assert_close(mine_x.grad, slice_of(whole_x.grad, x_cut), msg=lambda m: f"{name}: {m}")
    for key, p in mine_params.items():
        whole = plain.get_parameter(key).grad
        assert_close(p.grad, slice_of(whole, p.tensor_splits), msg=lambda m: f"{name} {key}: {m}")


def add_skipped_bias(layer, x):
    out = layer(x)
    assert isinstance(out, tuple), "skip_bias_add must return (output, bias)"
    return out[0] + out[1]


def compare_loss(name, loss_fn, kwargs, logits, target, logit_cut, loss_cut):
    """The loss of my logits block (and all the targets) against F.cross_entropy on all."""
    mine = slice_of(logits, logit_cut).clone().requires_grad_()
    whole = logits.clone().requires_grad_()
    loss = loss_fn(mine, target)
    ref = F.cross_entropy(whole.reshape(-1, whole.shape[-1]), target.reshape(-1), **kwargs)
    ref = ref.reshape(target.shape) if ref.dim() else ref
    assert_close(loss, slice_of(ref, loss_cut), msg=lambda m: f"{name}: {m}")
    upstream = torch.linspace(0.5, 1.5, ref.numel()).reshape(ref.shape)
    (loss * slice_of(upstream, loss_cut)).sum().backward()
    (ref * upstream).sum().backward()
    assert_close(mine.grad, slice_of(whole.grad, logit_cut), msg=lambda m: f"{name}: {m}")


def tie(embedding_cls, classifier_cls, **kwargs):
    embedding = embedding_cls(V, D)
    # a tied table is the embedding's: the classifier's weight_initializer leaves it alone
    classifier = classifier_cls(D, V, embedding.weight, True, weight_initializer=w_init,
                                bias_initializer=b_init, **kwargs)
    assert classifier.weight is embedding.weight
    return nn.Sequential(embedding, classifier)
