"""max_lora as arithmetic (engine/lora_capacity.py): the pool's bytes over the served rank's
footprint, which follows the mix of adapters held lately and a pool of another size at once."""

from __future__ import annotations

from loraplex.inference_server.engine.lora_capacity import HISTORY, LoraCapacity, largest_adapter_bytes


def test_before_any_adapter_the_largest_one_stands_in() -> None:
    shapes = {"q_proj": (64, 64), "v_proj": (64, 32)}
    largest = largest_adapter_bytes(shapes, num_layers=3, max_rank=8, element_size=2)
    assert largest == (3 * 8 * (128 + 96) + 4 * 64) * 2
    capacity = LoraCapacity(largest)
    assert capacity.max_lora(10 * largest) == 10 and capacity.max_lora(largest // 2) == 1  # never 0


def test_the_served_rank_follows_the_mix_and_the_pool_size() -> None:
    capacity = LoraCapacity(10_000)
    capacity.note({"a": 1000, "b": 1000, "c": 4000})
    assert capacity.max_lora(8000) == 8  # the median adapter: rank of a and b
    capacity.note({f"big{i}": 4000 for i in range(5)})
    assert capacity.max_lora(8000) == 2 and capacity.max_lora(16000) == 4  # mostly larger adapters now
    capacity.note({f"x{i}": 500 for i in range(HISTORY)})  # the old ones age out of the history
    assert capacity.served_footprint() == 500
