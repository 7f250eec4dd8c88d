"""What the optimizer costs in one step, beside its code: the trainable parameters' gradients
and AdamW state on the GPU, or, with the state in host memory (:class:`BackwardAdamW`), the
gradients it holds, the state in flight each way (``copy_window_bytes``) and the pinned state."""

from __future__ import annotations

from offloadkit.component import Footprint, FootprintOptions
from offloadkit.component import FootprintWorkload as Workload
from offloadkit.defaults import COMPACT_CHUNK_BYTES_PER_ELEMENT, COMPACT_CHUNK_ELEMENTS, OPTIMIZER_COPY_WINDOW_BYTES
from offloadkit.optim.options import OptimizerOptions

__all__ = ["optimizer_footprint"]


def optimizer_footprint(w: Workload, f: FootprintOptions) -> Footprint:
    """LoRA: each adapter parameter, its gradient and AdamW's two moments. A full fine-tune:
    gradients and state on the GPU, or with ``optimizer_offloading`` the gradients held (one
    at a time when updated in backward; every one until ``step()`` under clipping, fp16
    scaling or accumulation), the wider temporaries of the update's precision, and the state
    fetched ahead and on its way back (a window each; the two hold different parameters, so
    together never more than the state)."""
    s, b = w.shape, w.dtype_bytes
    ddp = w.parallel.ddp
    if w.lora_rank:
        adapters = s.lora_params(w.lora_rank) * w.adapter_bytes
        gpu = {"trainable state": adapters * 4}
        if ddp and not w.parallel.bucket_view:
            gpu["DDP gradient buckets"] = adapters
        return Footprint(gpu=gpu)
    # Sharded by FSDP2: each rank's share of the gradients and state, and one layer's whole
    # gradient before its reduce-scatter.
    shards = w.parallel.weight_shards
    params = -(-s.params // shards)
    unreduced = s.layer_params * b if shards > 1 else 0
    # Under DDP its buckets hold every gradient for the model's life: a second copy, or, with
    # gradient_as_bucket_view, the gradients themselves (then held whatever the optimizer frees).
    buckets = {"DDP gradient buckets": s.params * b} if ddp else {}
    if not f.of(OptimizerOptions).enabled:
        grads = 0 if ddp and w.parallel.bucket_view else params * b
        return Footprint(gpu={"trainable state": grads + params * w.optimizer_state_bytes + unreduced} | buckets)
    linear = max(a * c for a, c in s.linears)
    state = params * w.optimizer_state_bytes
    window = w.copy_window_bytes
    if window is None:
        window = OPTIMIZER_COPY_WINDOW_BYTES[w.optimizer_precision]

    def trainable(largest: int) -> dict[str, int]:
        """Gradients held (``largest``'s alone when updated in backward, else every one), the
        update's wider temporaries and the state in flight, with ``largest`` the widest
        parameter being updated."""
        largest = -(-largest // shards)
        held = largest if w.updates_in_backward else params
        grad = (0 if ddp and w.parallel.bucket_view else held * b) + unreduced
        if w.optimizer_precision == "fp32_master":
            grad += largest * 4  # the fp32 master update widens one whole gradient
        if w.optimizer_precision == "compact":
            grad += min(largest, COMPACT_CHUNK_ELEMENTS) * COMPACT_CHUNK_BYTES_PER_ELEMENT  # one chunk
        in_flight = min(2 * window, state) + largest * w.optimizer_state_bytes
        return {"trainable state": grad + in_flight}

    host = {"optimizer state": state}
    if w.updates_in_backward:
        # Updated as backward reaches each parameter: nothing of it is on the GPU before the
        # first gradient, so the loss phase (the logits) holds none of it. An untied head is
        # updated first, once its logits' gradient is freed; the embedding (tied or not) last,
        # after the first decoder layer's backward, when the layers' own saves are gone.
        # Measured (3B at 16K, fp32 master weights): the loss phase's peak held no state, the
        # layers' held 12.3 GiB of it coming in (the embedding's with the first layer's); with
        # every layer's matmul outputs saved, the peak came at backward's start, without it.
        during, first = max(linear, s.head_params), max(linear, s.embed_params)
        return Footprint(gpu=buckets, layer=trainable(during), layer_end=trainable(first), host=host)
    return Footprint(gpu=trainable(max(linear, s.embed_params, s.head_params)) | buckets, host=host)
