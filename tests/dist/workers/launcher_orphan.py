"""A rank that makes a shared-memory file of its job, says its pid, and runs until stopped."""

import os
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
rank, job = os.environ["TINYDIST_RANK"], os.environ["TINYDIST_JOB_ID"]
Path(f"/dev/shm/tinydist-{job}-rank{rank}").write_bytes(b"x")
(out / f"pid{rank}.tmp").write_text(str(os.getpid()))
(out / f"pid{rank}.tmp").rename(out / f"pid{rank}")
time.sleep(120)   # bounded: the test kills the launcher long before
