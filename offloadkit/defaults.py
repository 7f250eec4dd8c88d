"""The defaults of the settings that several components and the config share, stated once.

Every constructor, :class:`~offloadkit.config.OffloadConfig`, the planner and the bench read
them from here (plain values: no torch import).
"""

__all__ = [
    "MAX_FWD_STASH_SIZE",
    "COMPACT_CHUNK_ELEMENTS",
    "COMPACT_CHUNK_BYTES_PER_ELEMENT",
    "MIN_OFFLOAD_SIZE",
    "OPTIMIZER_COPY_WINDOW_BYTES",
    "OPTIMIZER_STATE_BYTES",
    "PREFETCH_BESIDE_STATE",
    "PREFETCH_FROM_DISK",
    "PREFETCH_FROM_RAM",
    "STATE_GROUPS_AHEAD",
    "STREAM_DEPTH",
]

# Smallest saved tensor worth moving, in bytes: below this a copy's fixed cost is more than
# the memory it frees.
MIN_OFFLOAD_SIZE = 1024
# Device sources kept alive while their copy to the host is in flight, before forward waits.
MAX_FWD_STASH_SIZE = 5
# Save groups (layers, with checkpointing) brought back ahead in backward when the user sets no
# ``activation_loading_horizon``: the storage tiers' ``default_prefetch``, and the planner's
# horizon. Reads from disk take longer than pinned copies (measured on an 8B LoRA step at 16K
# tokens: 3.86 s -> 3.77 s on disk, 3.33 s -> 3.17 s tiered with 4 instead of 2).
PREFETCH_FROM_RAM = 2
PREFETCH_FROM_DISK = 4
# ... and when a full fine-tune's optimizer state travels on the same link in backward (updated
# in backward, its state in host memory): block inputs then share the link's time with the
# state's copies, and come back from RAM as far ahead as from disk (measured on an H200 through
# the Trainer, 4 layers 2048 wide at 8K: the GPU's waits for activations 8.7 -> 0.1 ms a step,
# the step 70 -> 64 ms, 31 MiB more at the peak).
PREFETCH_BESIDE_STATE = 4
# Blocks of streamed weights resident at once: 2 is double buffering (one computing, one
# arriving).
STREAM_DEPTH = 2
# A full fine-tune's AdamW state per parameter of a bf16 model, by ``optimizer_precision``:
# "params" keeps two moments in the weights' dtype (pure bf16, as torch.optim.AdamW),
# "fp32_master" an fp32 master copy and fp32 moments, "compact" bf16 moments with the update
# rounded stochastically.
OPTIMIZER_STATE_BYTES = {"params": 4, "fp32_master": 12, "compact": 4}
# GPU bytes of optimizer state fetched ahead (and, apart, still going back) by BackwardAdamW.
# About one decoder layer's state keeps the link busy while the layer computes: with fp32
# master weights (12 bytes a parameter) an 8B step at 16K took 3.20 s with 1 GiB and 2.80 s
# with 4 GiB; with 4 bytes a parameter 1 and 4 GiB ran alike (2.53, 2.52 s), 64 MiB 5% slower.
OPTIMIZER_COPY_WINDOW_BYTES = {"params": 1 << 30, "compact": 1 << 30, "fp32_master": 4 << 30}
# Where the parameters updated together are known (each decoder layer's), optimizer state is
# fetched this many groups ahead within that window: the rest of the layer being updated and
# the next one, as block inputs come back two blocks ahead from RAM. The window alone, on a
# model whose state it holds whole, fetched all of it at backward's first update, and the
# block inputs' prefetches shared the link with it.
STATE_GROUPS_AHEAD = 2
# The compact optimizer state's update runs over chunks of this many elements, widened to fp32:
# about 40 bytes of temporaries an element (weight, gradient and moments in fp32, AdamW's
# intermediates, the rounding's noise and bit patterns), 640 MiB a chunk.
COMPACT_CHUNK_ELEMENTS = 1 << 24
COMPACT_CHUNK_BYTES_PER_ELEMENT = 40

# Where a decoder layer's input can wait for backward (``block_input_placement``): the first
# three are places a saved tensor can be; "recompute" keeps it nowhere.
BLOCK_INPUT_PLACES = ("gpu", "ram", "disk", "recompute")
