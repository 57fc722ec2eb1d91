"""Issue 34: setup's Gemma model-file write is atomic (pagedkv.engine.registry.assemble_atomic). Before, the part
package wrote the file in place: a run beside another one read it half-written, failed its sha256 with a
traceback (FileExistsError) and setup still exited 0. A fake part package; no model needed."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

from pagedkv.engine.registry import assemble_atomic

DATA = bytes(range(256)) * 4096  # 1 MiB


class FakeParts:
    """The part package's interface: assemble() writes the file in place, slowly (in 16 pieces)."""

    EXPECTED_SHA256 = hashlib.sha256(DATA).hexdigest()

    def __init__(self):
        self.calls = 0

    def assemble(self, output_path, overwrite=False):
        self.calls += 1
        with open(output_path, "wb") as f:
            for i in range(16):
                f.write(DATA[i * len(DATA) // 16:(i + 1) * len(DATA) // 16])
                f.flush()
                time.sleep(0.005)
        if hashlib.sha256(Path(output_path).read_bytes()).hexdigest() != self.EXPECTED_SHA256:
            raise ValueError("Assembled file sha256 did not match expected value")
        return Path(output_path)


def test_a_half_written_file_is_replaced_whole(tmp_path):
    target = tmp_path / "model.gguf"
    target.write_bytes(DATA[:1000])  # a run killed mid-write (or another run writing now)
    pkg = FakeParts()
    assert assemble_atomic(pkg, target) == target
    assert target.read_bytes() == DATA and pkg.calls == 1
    assert assemble_atomic(pkg, target) == target and pkg.calls == 1  # right already: kept
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]  # no temporary file left


def test_runs_side_by_side_never_see_a_partial_file(tmp_path):
    target = tmp_path / "model.gguf"
    pkg = FakeParts()
    seen, errors = [], []

    def run():
        try:
            seen.append(assemble_atomic(pkg, target).read_bytes() == DATA)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def watch():  # a reader looking at the path meanwhile sees nothing or the whole file
        for _ in range(100):
            if target.exists():
                seen.append(target.read_bytes() == DATA)
            time.sleep(0.002)

    ts = [threading.Thread(target=run) for _ in range(3)] + [threading.Thread(target=watch)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not errors and seen and all(seen)
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]
