"""The kernel-time breakdown that ``benchmarks/capacity.py --kernel-breakdown`` records:
groups by kernel name, the busiest stream as the compute stream, its idle time."""

import os
import sys
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import kernel_time  # noqa: E402


def _kernel(name, start_us, end_us, stream=7, device=DeviceType.CUDA):
    interval = SimpleNamespace(start=start_us, end=end_us)
    return SimpleNamespace(name=name, time_range=interval, device_resource_id=stream, device_type=device)


@pytest.mark.parametrize(
    "name, group",
    [
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", "attention"),
        ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80", "attention"),
        ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_NNT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("Memcpy HtoD (Pinned -> Device)", "copy"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "other"),
        ("triton_red_fused__to_copy_mean_pow_0", "other"),
    ],
)
def test_kernel_names_fall_in_their_group(name, group):
    assert kernel_time.group_of(name) == group


def test_the_busiest_stream_is_compute_and_its_gaps_are_idle():
    events = [
        _kernel("nvjet_tst_gemm", 0, 1_000_000),
        _kernel("flash_fwd_kernel", 1_500_000, 3_500_000),
        _kernel("elementwise_kernel", 3_000_000, 4_000_000),  # overlaps the attention kernel's end
        _kernel("Memcpy DtoH", 0, 2_000_000, stream=20),  # the side stream's copy
        _kernel("host op", 0, 9_000_000, device=DeviceType.CPU),  # not a kernel
    ]
    out = kernel_time.breakdown(events)
    assert out["compute_stream"] == 7
    assert out["compute_span_s"] == 4.0
    assert out["compute_busy_s"] == 3.5  # 1 + (1.5..4.0)
    assert out["compute_idle_s"] == 0.5
    assert out["groups_s"] == {"attention": 2.0, "gemm": 1.0, "other": 1.0}
    assert out["streams_busy_s"] == {"7": 3.5, "20": 2.0}
    assert out["top_kernels_s"][0] == ["flash_fwd_kernel", 2.0]


def test_the_compute_streams_gaps_name_what_other_streams_finished_inside_them():
    events = [
        _kernel("nvjet_tst_gemm", 0, 1_000_000),
        _kernel("short_kernel", 100_000, 200_000),  # inside the gemm's interval: no gap after it
        _kernel("flash_fwd_kernel", 1_500_000, 3_500_000),
        _kernel("elementwise_kernel", 3_500_050, 4_000_000),  # 50 us: too short to list
        _kernel("Memcpy HtoD (Pinned -> Device)", 1_000_000, 1_400_000, stream=20),
        _kernel("ncclDevKernel_ReduceScatter", 900_000, 1_450_000, stream=24),
    ]
    out = kernel_time.breakdown(events)
    assert out["compute_gaps_over_100us"] == 1
    assert out["compute_gaps_over_100us_s"] == 0.5
    (gap,) = out["compute_longest_gaps"]
    assert gap["at_s"] == 1.0 and gap["ms"] == 500.0
    assert gap["before"] == "nvjet_tst_gemm" and gap["after"] == "flash_fwd_kernel"
    assert gap["ended_inside"] == {"20": "Memcpy HtoD (Pinned -> Device)", "24": "ncclDevKernel_ReduceScatter"}
    assert gap["in_flight"] == {
        "20": [["Memcpy HtoD (Pinned -> Device)", 0.0, 400.0]],
        "24": [["ncclDevKernel_ReduceScatter", -100.0, 550.0]],
    }


def _waiting_behind_copies(after: str) -> list:
    """The compute stream idle from 10 to 40 ms while three copies run back to back on stream
    13, the first started 5 ms before the wait."""
    return [
        _kernel("elementwise_kernel", 0, 10_000),
        _kernel(after, 40_000, 41_000),
        _kernel("Memcpy HtoD (Pinned -> Device)", 5_000, 15_000, stream=13),
        _kernel("Memcpy HtoD (Pinned -> Device)", 15_000, 25_000, stream=13),
        _kernel("Memcpy HtoD (Pinned -> Device)", 25_000, 39_000, stream=13),
    ]


def test_a_copy_queued_behind_others_shows_every_copy_that_ran_during_the_wait():
    """The compute stream waits 30 ms for a copy that was queued behind two others on the
    copy stream: all three are listed, the first started before the wait began."""
    events = _waiting_behind_copies("Memcpy DtoD (Device -> Device)") + [
        _kernel("Memcpy HtoD (Pinned -> Device)", 39_500, 45_000, stream=13),  # after the wait
    ]
    (gap,) = kernel_time.breakdown(events)["compute_longest_gaps"]
    assert gap["ms"] == 30.0
    assert [[start, ms] for _, start, ms in gap["in_flight"]["13"]] == [
        [-5.0, 10.0],
        [5.0, 10.0],
        [15.0, 14.0],
        [29.5, 5.5],
    ]


def test_a_copy_bound_steps_compute_stream_is_not_its_copy_stream():
    events = [
        _kernel("nvjet_tst_gemm", 0, 1_000_000),
        _kernel("Memcpy HtoD (Pinned -> Device)", 0, 5_000_000, stream=20),  # busier, but copies
    ]
    out = kernel_time.breakdown(events)
    assert out["compute_stream"] == 7
    assert out["groups_s"] == {"gemm": 1.0}


def _trace(*copies):
    """A Chrome trace of the profile: per copy (stream, start us, us, bytes, host call us)."""
    events = []
    for i, (stream, start, dur, nbytes, called) in enumerate(copies):
        events.append({"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": called, "args": {"correlation": i}})
        events.append(
            {
                "cat": "gpu_memcpy",
                "name": "Memcpy HtoD (Pinned -> Device)",
                "ts": start,
                "dur": dur,
                "args": {"stream": stream, "correlation": i, "bytes": nbytes},
            }
        )
    return {"traceEvents": events}


def test_the_copies_in_a_gap_carry_their_size_and_how_long_they_sat_queued():
    """Two copies asked for at once, long before the wait: the second, queued behind the
    first, started 10 ms after its call; the third was asked for as the wait began."""
    events = _waiting_behind_copies("flash_bwd_kernel")
    mib = 1 << 20
    launches = kernel_time.copy_launches(
        _trace(
            (13, 1_005_000, 10_000, 512 * mib, 1_004_000),
            (13, 1_015_000, 10_000, 512 * mib, 1_004_000),
            (13, 1_025_000, 14_000, 8 * mib, 1_024_500),
        )
    )
    assert launches[13][1] == (1_015_000, 10_000, 512 * mib, 11.0)
    (gap,) = kernel_time.breakdown(events, launches=launches)["compute_longest_gaps"]
    assert gap["in_flight"]["13"] == [
        ["Memcpy HtoD (Pinned -> Device)", -5.0, 10.0, 512.0, 1.0],
        ["Memcpy HtoD (Pinned -> Device)", 5.0, 10.0, 512.0, 11.0],
        ["Memcpy HtoD (Pinned -> Device)", 15.0, 14.0, 8.0, 0.5],
    ]


def test_copies_the_trace_does_not_pair_stay_unnamed():
    events = [
        _kernel("elementwise_kernel", 0, 10_000),
        _kernel("flash_bwd_kernel", 40_000, 41_000),
        _kernel("Memcpy HtoD (Pinned -> Device)", 15_000, 25_000, stream=13),
    ]
    other_durations = kernel_time.copy_launches(_trace((13, 0, 9_000, 1 << 20, 0)))
    (gap,) = kernel_time.breakdown(events, launches=other_durations)["compute_longest_gaps"]
    assert gap["in_flight"]["13"] == [["Memcpy HtoD (Pinned -> Device)", 5.0, 10.0]]
