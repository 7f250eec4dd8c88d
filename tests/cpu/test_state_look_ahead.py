"""How far ahead optimizer state is fetched: a byte window alone, or, where the parameters
updated together are named (each decoder layer's, as the Trainer integration names them),
groups within that window. The walk is the scheduler's; the copies are stubbed (no GPU)."""

import pytest
import torch

from offloadkit.optim import BackwardAdamW
from offloadkit.optim.state_copies import StateCopies
from offloadkit.testing import build_llama


def _copies(sizes: list[int], window: int) -> tuple[StateCopies, list[torch.Tensor], list[int]]:
    params = [torch.zeros(n) for n in sizes]
    states = {id(p): {"exp_avg": torch.zeros(n)} for p, n in zip(params, sizes)}
    copies = StateCopies(lambda p: (states[id(p)], ("exp_avg",)), window)
    fetched: list[int] = []
    index = {id(p): i for i, p in enumerate(params)}
    copies._lane.fetch = lambda item: fetched.append(index[id(item[0])])  # the copy itself needs a GPU
    return copies, params, fetched


def _walk(copies: StateCopies, params: list[torch.Tensor], after: int) -> None:
    copies.scheduler.prefetch(copies._lane, copies._upcoming(params[after + 1 :]), copies._ahead_rule)


def test_without_groups_the_byte_window_fetches_as_far_as_it_holds():
    copies, params, fetched = _copies([100] * 6, window=10_000)
    _walk(copies, params, after=0)
    assert fetched == [1, 2, 3, 4, 5]  # every state the window holds, at the first update


def test_with_groups_the_rest_of_the_current_group_and_the_next_one():
    copies, params, fetched = _copies([100] * 6, window=10_000)
    copies.set_groups([params[0:2], params[2:4], params[4:6]], ahead=2)
    _walk(copies, params, after=0)
    assert fetched == [1, 2, 3]
    # A parameter in no group is a group of its own; the window still bounds the bytes.
    copies, params, fetched = _copies([100, 100, 1000, 1000, 100], window=6000)  # fp32: 4 bytes an element
    copies.set_groups([params[2:4]], ahead=3)
    _walk(copies, params, after=-1)
    assert fetched == [0, 1, 2, 3]  # three groups: {0}, {1}, {2, 3}
    copies, params, fetched = _copies([100, 100, 1000, 1000, 100], window=2000)
    copies.set_groups([params[2:4]], ahead=3)
    _walk(copies, params, after=-1)
    assert fetched == [0, 1, 2]  # the window is full after the item that crossed it


def test_no_groups_or_none_ahead_keep_the_byte_window():
    copies, params, fetched = _copies([100] * 4, window=10_000)
    copies.set_groups([], ahead=2)
    _walk(copies, params, after=0)
    assert fetched == [1, 2, 3]
    with pytest.raises(ValueError, match="ahead=-1"):
        copies.set_groups([params], ahead=-1)


def test_the_trainer_integration_groups_each_decoder_layers_parameters(tmp_path):
    transformers = pytest.importorskip("transformers")
    from offloadkit.integrations.optimizer import backward_adamw_for

    model = build_llama("tiny")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], max_grad_norm=0.0, use_cpu=True)
    trainer = transformers.Trainer(model=model, args=args)
    from offloadkit.config import OffloadConfig

    optimizer, _ = backward_adamw_for(trainer, OffloadConfig(optimizer_offloading=True))
    assert isinstance(optimizer, BackwardAdamW)
    groups = optimizer._copies._group
    layers = model.model.layers
    assert {groups[id(p)] for p in layers[0].parameters()} == {0}
    assert {groups[id(p)] for p in layers[1].parameters()} == {1}
    assert id(model.model.embed_tokens.weight) not in groups  # outside the layers: its own group


@pytest.mark.parametrize(
    "updates_in_backward, asked, expected",
    [(True, None, 4), (False, None, None), (True, 3, 3)],
)
def test_block_inputs_come_back_further_ahead_where_state_travels_in_backward(updates_in_backward, asked, expected):
    """BackwardAdamW's state copies share the link in backward: block inputs come back as far
    ahead as from disk, unless the config says how far; the planner counts the same."""
    import warnings

    from offloadkit.component import OptionSet
    from offloadkit.compose import prepare
    from offloadkit.engine.footprint import activations_footprint
    from offloadkit.engine.options import ActivationOptions
    from offloadkit.planning import OptimizerSetup
    from offloadkit.planning.memory import Workload
    from offloadkit.planning.plan import place_inputs, planned_options, with_options
    from offloadkit.planning.shape import ModelShape

    config = {"gradient_checkpointing": True, "activation_offloading": True, "optimizer_offloading": True}
    if asked is not None:
        config["activation_loading_horizon"] = asked
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no CUDA here: the engine notes it has no effect
        setup = OptimizerSetup(updates_in_backward=updates_in_backward)
        runtime = prepare(build_llama("tiny"), config, optimizer=setup)
    try:
        assert runtime.config.activation_loading_horizon == expected
    finally:
        runtime.close()
    dims = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4}
    shape = ModelShape.from_config(dict(dims, vocab_size=256))
    work = Workload(shape, seq_len=1024, updates_in_backward=updates_in_backward)
    offloaded = place_inputs(work, planned_options(work, offload_inputs=True, optimizer_offloading=True))
    held = activations_footprint(work, OptionSet(with_options(offloaded, ActivationOptions, loading_horizon=asked)))
    blocks = held.gpu["block inputs"] // work.block_input_bytes
    assert blocks == 1 + (expected or 2)  # the last layer's input stays, and the horizon comes back ahead
