"""The peak RSS of a span, also when the peak is in its middle."""

import psutil

from offloadkit.bench.rss import PeakRss


def test_peak_in_the_middle_of_a_span_is_seen():
    probe = PeakRss().start()
    before = psutil.Process().memory_info().rss
    block = bytearray(256 << 20)  # touched pages: 256 MiB resident, then freed
    block[::4096] = b"\1" * len(block[::4096])
    del block
    peak = probe.stop()
    assert peak >= before + (200 << 20), (peak, before, probe.method)
    assert psutil.Process().memory_info().rss < peak


def test_sampling_fallback(monkeypatch):
    import offloadkit.bench.rss as rss

    monkeypatch.setattr(rss, "_reset_hwm", lambda: False)
    probe = PeakRss(interval=0.0005).start()
    assert probe.method.startswith("sampled")
    block = bytearray(128 << 20)
    block[::4096] = b"\1" * len(block[::4096])
    import time

    time.sleep(0.05)
    before_free = psutil.Process().memory_info().rss
    del block
    assert probe.stop() >= before_free - (16 << 20)
