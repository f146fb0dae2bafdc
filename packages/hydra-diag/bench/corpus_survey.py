"""How much source text a machine holds, by folder and file extension: which ``--corpus_root``
folders and ``--extensions`` a race corpus of a given size can use on it.

    python packages/hydra-diag/bench/corpus_survey.py --out survey.json /usr/local/cuda /usr/include env

``env`` is the interpreter's library and package folders (as ``hydra-diag race corpus`` reads
them). Counted: regular files of at most 4 MB (the corpus's own cap) without NUL bytes in their
first 4 KiB; printed per root: the extensions with the most bytes.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path

MAX_FILE_BYTES = 4_000_000


def survey(root: Path) -> dict[str, list[int]]:
    by_ext: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # ext -> [files, bytes]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for fn in filenames:
            p = os.path.join(dirpath, fn)
            try:
                st = os.stat(p)
                if not os.path.isfile(p) or st.st_size == 0 or st.st_size > MAX_FILE_BYTES:
                    continue
                with open(p, "rb") as f:
                    if b"\0" in f.read(4096):
                        continue
            except OSError:
                continue
            ext = fn.rsplit(".", 1)[-1].lower() if "." in fn else "(none)"
            by_ext[ext][0] += 1
            by_ext[ext][1] += st.st_size
    return dict(by_ext)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("roots", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    roots: list[Path] = []
    for r in args.roots:
        if r == "env":
            from hydra_train.pyenv_corpus import environment_roots

            roots += [path for _, path in environment_roots()]
        else:
            roots.append(Path(r))
    result = {}
    for root in roots:
        if not root.is_dir():
            print(f"{root}: not a folder")
            continue
        found = survey(root)
        result[str(root)] = found
        total = sum(b for _, b in found.values())
        print(f"{root}: {total / 1e6:.0f} MB text in {sum(n for n, _ in found.values())} files")
        for ext, (n, b) in sorted(found.items(), key=lambda kv: -kv[1][1])[: args.top]:
            print(f"   {ext:12s} {b / 1e6:9.1f} MB {n:8d} files")
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
