"""Twin GPU samples: written by a busy twin engine, read from another process, idle GPUs filled in."""
import subprocess
import sys
import time

import httpx

from appliance.inventory import detect
from appliance.twin import gpus

from .conftest import ROOT, prompt_text


def test_engine_activity_drives_samples(procs, tmp_path):
    state = tmp_path / "gpu-1.json"
    port, proc = procs.engine("both", None, "--gpu-index", "1", "--state-file", str(state))
    inv = detect("twin:2xA100-80GB")
    deadline = time.monotonic() + 30                  # written every 0.5 s
    while not state.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    idle = {s.index: s for s in gpus.read_samples(tmp_path, inventory=inv)}
    assert set(idle) == {0, 1}
    assert idle[0].source == "twin:idle" and idle[0].processes == ()
    assert idle[1].processes[0]["pid"] == proc.pid
    assert idle[1].mem_used_bytes > 0.8 * idle[1].mem_total_bytes     # vLLM preallocates
    # a long decode keeps the engine busy for ~1.5 s
    body = {"model": "twin-m", "prompt": prompt_text(0, 2000, 1), "max_tokens": 40}
    t = subprocess.Popen([sys.executable, "-c", f"import httpx; httpx.post('http://127.0.0.1:{port}/v1/completions', "
                          f"json={body!r}, timeout=30)"], cwd=ROOT)
    busy = []
    deadline = time.monotonic() + 30                  # samples while the request runs (~1.5 s + the client's start)
    while t.poll() is None and time.monotonic() < deadline:
        time.sleep(0.3)
        busy += [s.util_pct for s in gpus.read_samples(tmp_path) if s.index == 1]
    t.wait(timeout=30)
    # utilisation = the steps' model time over the wall time of a 0.5 s sample: ~100 % while it decodes, 0 idle. A
    # busy machine stretches the wall time between steps (lower %), so the bound only tells busy from idle
    assert max(busy) > 25, busy
    s = gpus.read_samples(tmp_path)[0]
    assert s.power_w <= s.power_limit_w and s.temp_c >= gpus.AMBIENT_C


def test_stale_or_broken_files_read_as_idle(tmp_path):
    (tmp_path / "gpu-0.json").write_text("{broken")
    old = gpus.GpuSample(index=1, name="NVIDIA H200", util_pct=90.0, mem_used_bytes=1, mem_total_bytes=2,
                         temp_c=70.0, power_w=600.0, power_limit_w=700.0, processes=(), updated_at=time.time() - 60,
                         source="twin:x")
    gpus.write_state(tmp_path / "gpu-1.json", old)
    out = gpus.read_samples(tmp_path, inventory=detect("twin:2xH200"))
    assert [s.source for s in out] == ["twin:idle", "twin:idle"]
    assert out[1].power_w == 75.0 and out[1].power_limit_w == 700.0
    assert gpus.sample(tmp_path) == []
