"""The layout the architecture promises, read from the source tree by
``scripts/architecture_counts.py``: a new side stream outside ``transfer/``, a second copy of
the copy choreography, a keep rule outside ``engine/decide.py`` or a product import of the
test helpers fails here."""

import importlib.util
import os

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _counts():
    spec = importlib.util.spec_from_file_location(
        "architecture_counts", os.path.join(ROOT, "scripts", "architecture_counts.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.counts(os.path.join(ROOT, "offloadkit"))


def test_one_transfer_layer_one_decision_module_no_test_helpers_in_the_product():
    counts = _counts()
    assert counts["side streams created outside transfer/"]["count"] == 0, counts
    assert counts["copies of the copy choreography"]["where"] == ["offloadkit/transfer/copy.py:queue_copy"]
    assert counts["keep/offload decision sites outside engine/decide.py"]["count"] == 0, counts
    assert counts["product modules importing test helpers"]["count"] == 0, counts
    assert counts["files that mutate an Entry"]["where"] == ["offloadkit/engine/spans.py"]
    assert counts["prefetch schedulers"]["where"] == ["offloadkit/transfer/prefetch.py:PrefetchScheduler"]
    assert counts["step-timeline hook sites outside transfer/timeline.py"]["count"] == 0, counts
