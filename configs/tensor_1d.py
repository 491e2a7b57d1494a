# Megatron-style 1d tensor parallelism over 2 processes:
#   torchrun --nproc_per_node 2 train_tensor.py --config configs/tensor_1d.py
BATCH_SIZE = 64           # per data-parallel replica
NUM_EPOCHS = 2

parallel = dict(
    tensor=dict(size=2, mode='1d'),
)
