"""One srun task of deploy/slurm/train.sbatch in tests/cluster/test_slurm.py: first ask the job's
scheduler for its status where the recipe says it is (TINYDIST_SCHEDULER: the first node's name and
the job's port, over this task's certificate), so the job's output shows the `--this-host`
certificate accepted by name; then run the script given as that script would run.

    python slurm_task.py SCRIPT ARGS...     (the recipe's `python "$@"`)
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import time

target = os.environ["TINYDIST_SCHEDULER"]
deadline = time.monotonic() + 60        # the recipe starts the scheduler in the background just before srun
while True:
    asked = subprocess.run([sys.executable, "-m", "tinydist.cli", "cluster", "status", "--coordinator", target],
                           capture_output=True, text=True, timeout=60)
    # a mismatch is final (exit 1 with SchedulerNameMismatch's message); only a scheduler not yet up is waited for
    if asked.returncode == 0 or "connection refused" not in asked.stderr.lower() or time.monotonic() > deadline:
        break
    time.sleep(0.2)
print(f"scheduler {target}: cluster status exit {asked.returncode} {asked.stderr.strip()}", flush=True)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
