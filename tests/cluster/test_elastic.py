"""An elastic restart (Build item 2): a 3-rank job trains with a sharded checkpoint each step, one rank
dies (SIGKILL), the survivors' processes restart and form a rendezvous round of 2 (min 2, max 3),
load the 3-rank checkpoint resharded to 2 and finish. The result equals, bit for bit, an
uninterrupted 2-rank run from the same checkpoint step, and numpy's float64 training up to rounding."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.cluster.helpers import ROOT, Coordinator, Output, env
from tests.cluster.workers.elastic import reference
from tinydist.scheduler import checkpoint as ck

WORKER = Path(__file__).parent / "workers" / "elastic.py"
STEPS, DIE_AT = 12, 5


def _start(coordinator: str, node: int, ckpt: Path, *args: str, lo: int = 2, hi: int = 3,
           last_call: float = 2.0, prefix: str = "node") -> Output:
    return Output(subprocess.Popen(
        [sys.executable, str(WORKER), "--coordinator", coordinator, "--node-id", f"{prefix}-{node}", "--rank", str(node),
         "--min", str(lo), "--max", str(hi), "--last-call", str(last_call), "--steps", str(STEPS), "--ckpt", str(ckpt),
         *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env=env(TINYDIST_TRANSPORT="tcp", TINYDIST_COLLECTIVE_TIMEOUT="30")))


def test_elastic_restart_from_3_ranks_to_2_equals_an_uninterrupted_2_rank_run_from_that_step(tmp_path):
    c = Coordinator(tmp_path, "--insecure-loopback-only")
    ckpt, ref_ckpt = tmp_path / "ckpt", tmp_path / "ref-ckpt"
    out, ref_out = tmp_path / "elastic.npy", tmp_path / "ref.npy"
    procs: list[Output] = []
    try:
        # round 1: three nodes (a long last call: the round closes when the third arrives)
        procs = [_start(c.address, i, ckpt, *(["--die-at", str(DIE_AT)] if i == 2 else []), last_call=60.0)
                 for i in range(3)]
        codes = [p.finish(120) for p in procs]
        texts = [p.text for p in procs]
        assert codes == [3, 3, -9], texts
        assert all("ROUND 1 world=3" in t for t in texts), texts
        resume = ck.latest(ckpt)
        assert resume == DIE_AT - 1 and ck.committed(ckpt, resume)["world_size"] == 3, texts
        shutil.copytree(ckpt / f"step-{resume:08d}", ref_ckpt / f"step-{resume:08d}")
        # round 2: the survivors' restarted processes (new incarnations); node-2 never comes back
        procs = [_start(c.address, i, ckpt, "--out", str(out)) for i in range(2)]
        codes = [p.finish(120) for p in procs]
        texts = [p.text for p in procs]
        assert codes == [0, 0], texts
        pids = [p.proc.pid for p in procs]
        for t in texts:
            assert "ROUND 2 world=2 rank=" in t and f"members=[('node-0', {pids[0]}), ('node-1', {pids[1]})]" in t, t
            assert f"RESUMED from step {resume} (3 ranks -> 2)" in t, t
        # the reference: an uninterrupted 2-rank job (a round of exactly 2) from the same checkpoint step
        procs = [_start(c.address, i, ref_ckpt, "--out", str(ref_out), lo=2, hi=2, prefix="ref") for i in range(2)]
        codes = [p.finish(120) for p in procs]
        texts = [p.text for p in procs]
        assert codes == [0, 0], texts
        assert all("ROUND 3 world=2" in t and f"RESUMED from step {resume} (3 ranks -> 2)" in t for t in texts), texts
    finally:
        for p in procs:
            p.close()
        c.stop()
    elastic, uninterrupted = np.load(out), np.load(ref_out)
    assert np.array_equal(elastic, uninterrupted)
    want = reference(STEPS)
    at_resume = np.concatenate([ck.load_shard(ref_ckpt, resume, r)["w"] for r in range(3)])
    np.testing.assert_allclose(at_resume, reference(resume + 1), rtol=1e-9, atol=1e-12)   # the 3-rank part
    np.testing.assert_allclose(elastic, want, rtol=1e-9, atol=1e-12)
    moved = np.abs(elastic - at_resume).max()
    print(f"resumed at step {resume} of {STEPS}: the 2-rank steps moved w by up to {moved:.3g}; elastic vs "
          f"uninterrupted: equal; vs numpy float64: max |diff| {np.abs(elastic - want).max():.3g}")
    assert moved > 1e-3                             # the resumed steps trained
