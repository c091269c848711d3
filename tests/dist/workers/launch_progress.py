"""A rank that reports progress, then waits to be let go (argv[1]: a file the test creates once it has
seen every rank's progress): lines that arrive before then were forwarded live, not at exit.
Two kinds: tinydist.base.progress (plain lines into the launcher's pipe) and a raw tqdm bar, whose
`\r` redraws into a pipe end in no newline until it is closed."""

import os
import sys
import time
from pathlib import Path

from tqdm import tqdm

from tinydist.base.progress import progress

rank = int(os.environ["RANK"])
release = Path(sys.argv[1])
for _ in progress(range(8), desc=f"work{rank}", file=sys.stdout, unit="step", lines=4):
    pass
bar = tqdm(total=3, desc=f"raw{rank}", file=sys.stdout, mininterval=0, miniters=1, ascii=True)
for _ in range(3):
    bar.update()
while not release.exists():   # the bar stays open: its last redraw has no newline yet
    time.sleep(0.02)
bar.close()
print(f"done{rank}", flush=True)
