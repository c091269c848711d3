"""Regenerate process-replay goldens: `python -m tests.schedule.process_replay_update [GRAPH ...]`.

With no names, every graph's golden is rewritten and goldens of graphs no longer in the corpus are
removed. Run it only for a change meant to alter schedules or IR, and review the diff it leaves.
"""

from __future__ import annotations

import argparse

import llvmlite

from .process_replay_corpus import GOLDEN_DIR, GRAPHS, LLVMLITE_VERSION_FILE, golden_path, render


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.schedule.process_replay_update", description=__doc__.splitlines()[0])
    parser.add_argument("graphs", nargs="*", metavar="GRAPH", help=f"graphs to regenerate (default: all {len(GRAPHS)})")
    args = parser.parse_args(argv)
    unknown = [name for name in args.graphs if name not in GRAPHS]
    if unknown:
        parser.error(f"no graph named {', '.join(unknown)}; the corpus has: {', '.join(GRAPHS)}")
    GOLDEN_DIR.mkdir(exist_ok=True)
    for name in args.graphs or GRAPHS:
        path = golden_path(name)
        text = render(name)
        old = path.read_text(encoding="utf-8") if path.exists() else None
        if text != old:
            path.write_text(text, encoding="utf-8")
        print(f"{'unchanged' if text == old else 'new' if old is None else 'updated':<9}  {path}")
    if not args.graphs:  # the whole corpus was written by this llvmlite
        for path in sorted(GOLDEN_DIR.glob("*.txt")):
            if path.stem not in GRAPHS:
                path.unlink()
                print(f"{'removed':<9}  {path}")
        LLVMLITE_VERSION_FILE.write_text(llvmlite.__version__ + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
