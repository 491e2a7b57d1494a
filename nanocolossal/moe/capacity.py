"""An expert's capacity C = max(ceil(capacity_factor * n / E), min_capacity), n this rank's
tokens (router.py teaches it), in plain numbers: plan/traffic.py counts with it, without torch."""
import math

MIN_CAPACITY = 4  # Colossal-AI's default


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: float,
                    min_capacity: int = MIN_CAPACITY) -> int:
    # rounded first: 1.1 * 100 / 10 is 11.000000000000002 in floating point, and C is 11
    return max(math.ceil(round(capacity_factor * num_tokens / num_experts, 9)), min_capacity)
