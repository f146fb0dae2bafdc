#!/usr/bin/env bash
# More source text for a 10-minute race than the GPU machine holds: its own interpreter, headers and
# docs give ~200M training tokens, and the dense GPT reads ~270M in 600 s on an H100. This packs the
# text files of seventeen pure-source PyPI wheels (none installed on that machine's image; pinned, so
# the corpus is the same every time) into one archive to carry there and unpack as a --corpus_root.
#
#   bash packages/hydra-diag/bench/extra_corpus.sh .corpus/extra_src.tar.xz   # here, with network
#   # on the GPU machine (the archive carried in an ignored folder):
#   mkdir -p /tmp/extra_src && tar xJf .corpus/extra_src.tar.xz -C /tmp/extra_src
#   ... race run ... --corpus_root env --corpus_root /tmp/extra_src ...
#
# 2026-11-25: 40107 files, 398.6 MB of text, 36.6 MB as .tar.xz (under the GPU tool's 64 MiB).
# Files: .py .pyi .md .rst .txt .c .h .yml .yaml under 4 MB (the corpus's own cap).
set -euo pipefail
out=$(realpath -m "${1:?usage: extra_corpus.sh OUT.tar.xz}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
wheels=(
  ansible==14.5.0 ansible-core==2.21.5 astropy==8.0.2 biopython==1.88 dask==2026.8.0
  django==6.1.3 homeassistant==2025.1.4 kubernetes==37.0.2 mypy==2.4.1 nltk==3.10.4
  openstacksdk==4.22.0 pylint==4.1.4 pyomo==6.10.1 qiskit==2.6.2 sphinx==9.1.1
  sqlalchemy==2.1.9 twisted==26.10.0
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$work/wheels" "${wheels[@]}"
mkdir -p "$work/src"
for w in "$work"/wheels/*.whl; do
  name=$(basename "$w"); name=${name%%-*}
  mkdir -p "$work/src/$name"
  python3 -m zipfile -e "$w" "$work/src/$name"
done
(cd "$work/src" && find . -type f \( -name '*.py' -o -name '*.pyi' -o -name '*.md' -o -name '*.rst' \
  -o -name '*.txt' -o -name '*.c' -o -name '*.h' -o -name '*.yml' -o -name '*.yaml' \) -size -4000k \
  | LC_ALL=C sort > "$work/list.txt")
mkdir -p "$(dirname "$out")"
(cd "$work/src" && tar cf - -T "$work/list.txt" | xz -9 -T0 > "$out.tmp") && mv "$out.tmp" "$out"
echo "$(wc -l < "$work/list.txt") files -> $out ($(du -h "$out" | cut -f1))"
