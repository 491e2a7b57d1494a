# The small byte-level GPT with a mixture of experts in every other block, the experts spread
# over 2 processes (expert parallelism, Colossal-AI's MoE tutorial):
#   torchrun --nproc_per_node 2 train_gpt.py --config configs/gpt_moe.py
BATCH_SIZE = 16           # sequences per data-parallel rank and step (global 32 on 2 ranks)
NUM_EPOCHS = 2            # 2 x 131 steps
SEQ_LEN = 64              # tokens (bytes) per sequence

# the model
DIM = 128
DEPTH = 4
HEADS = 4
MLP_RATIO = 4
DROPOUT = 0.0             # 0: every layout's loss equals one process's

# mixture of experts: blocks 2 and 4 hold NUM_EXPERTS MLPs each, every token uses MOE_TOP_K
NUM_EXPERTS = 4
MOE_TOP_K = 1             # Switch routing: the compute per token of the dense GPT
MOE_CAPACITY_FACTOR = 4.0  # >= NUM_EXPERTS: no token is ever dropped (1.25 is usual)
MOE_AUX_WEIGHT = 0.01     # the load-balancing loss's weight (Colossal-AI's MoeLoss default)

MOE_MODEL_PARALLEL_SIZE = 2  # experts per layer split over 2 of the data-parallel ranks
parallel = dict(
    moe=dict(size=MOE_MODEL_PARALLEL_SIZE),
)
