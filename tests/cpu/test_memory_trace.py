"""benchmarks/memory_trace.py: the allocator's recorded history replayed to the moments of peak
reservation and peak allocation, live blocks grouped by the code that allocated them."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import memory_trace  # noqa: E402

G = 1 << 30


def test_the_peaks_and_what_was_live_at_them():
    state = [{"filename": "/site/offloadkit/optim/state_copies.py", "name": "_queue_in"}]
    trace = [
        {"action": "segment_map", "size": 4 * G},
        {"action": "alloc", "size": 2 * G, "addr": 1, "frames": state},
        {"action": "alloc", "size": G, "addr": 2, "frames": []},
        {"action": "free_completed", "size": 2 * G, "addr": 1},
        {"action": "free_completed", "size": G, "addr": 9},  # allocated before the recording
        {"action": "segment_map", "size": G},
    ]
    got = memory_trace.summarize({"device_traces": [trace]}, {"reserved": 0, "allocated": G})
    assert got["at_peak_allocated"] == {
        "reserved_gib": 4.0,
        "allocated_gib": 4.0,
        "unallocated_gib": 0.0,
        "groups_gib": {
            "offloadkit/optim/state_copies.py:_queue_in": 2.0,
            "no Python frame": 1.0,
            "before the recording": 1.0,
        },
    }
    assert got["at_peak_reserved"]["reserved_gib"] == 5.0
    assert got["at_peak_reserved"]["groups_gib"] == {"no Python frame": 1.0}  # the earlier block was freed
