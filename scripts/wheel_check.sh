#!/usr/bin/env bash
# The wheel as a user gets it: built from this tree, installed into a clean venv with only the dependencies
# it declares (fetched from the package index), and its command line run there on a small pool in /dev/shm,
# on a pipe and on a terminal (where rich draws the tables). Any error fails the check.
# The build runs with the project venv's pip (bootstrapped here); BUILD_PYTHON names another interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${BUILD_PYTHON:-}" ]; then
    bash scripts/bootstrap.sh
    BUILD_PYTHON=.venv/bin/python
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/maru-wheel-check.XXXXXX")
pool=/dev/shm/maru-wheel-check-$$-$RANDOM
trap 'rm -f "$pool"; rm -rf "$work"' EXIT
fail() { echo "wheel_check: FAILED: $*" >&2; exit 1; }
say() { echo "wheel_check: $*"; }

# Build from a copy of the files git tracks or would track: no build/ leftovers or .venv reach the wheel.
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard |
    tar --null --ignore-failed-read -T - -cf - | tar -xf - -C "$work/src"
"$BUILD_PYTHON" -m pip wheel -v --no-deps "$work/src" -w "$work/dist" >"$work/build.log" 2>&1 ||
    { cat "$work/build.log"; fail "the wheel did not build"; }
if grep -i "deprecat" "$work/build.log"; then fail "the build warns of a deprecation (lines above)"; fi
wheel=$(ls "$work"/dist/*.whl)
say "built $(basename "$wheel"), no deprecation warning"

python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet "$wheel" || fail "the wheel did not install with its dependencies"
say "installed into a clean venv: $("$work/venv/bin/python" -m pip list --format=freeze | tr '\n' ' ')"

# Run from an empty directory with the venv alone on the path: nothing is imported from this tree.
mkdir "$work/cwd"
m() { (cd "$work/cwd" && env -u PYTHONPATH -u MARU_SHM_DEBUG PATH="$work/venv/bin:$PATH" "$@"); }
on_tty() {  # run a command line under a pseudo-terminal (util-linux script), output to stdout
    (cd "$work/cwd" && env -u PYTHONPATH -u MARU_SHM_DEBUG -u NO_COLOR TERM=xterm-256color COLUMNS=120 LINES=50 \
        PATH="$work/venv/bin:$PATH" script -qec "$1" /dev/null)
}

m maru-shm --version
m python -m maru_shm --version
m maru-shm create "$pool" --size 64M
m python -c "import sys; from maru_shm import Store
with Store.open(sys.argv[1]) as s:
    s.put('k', b'v' * 5000)
    assert s.get('k') == b'v' * 5000" "$pool" || fail "put/get through the installed maru_shm"
m maru-shm inspect "$pool" >"$work/inspect.txt" || { cat "$work/inspect.txt"; fail "inspect"; }
grep -q "Size classes" "$work/inspect.txt" || { cat "$work/inspect.txt"; fail "inspect printed no summary"; }
m maru-shm inspect "$pool" --json | m python -c "import json, sys; json.load(sys.stdin)" || fail "inspect --json"
m maru-shm check "$pool"
for cmd in "maru-shm inspect $pool" "maru-shm watch $pool --count 1"; do
    on_tty "$cmd" >"$work/tty.txt" 2>&1 || { cat "$work/tty.txt"; fail "$cmd, on a terminal"; }
    if grep -q "Traceback" "$work/tty.txt" || ! grep -q "Size classes" "$work/tty.txt" ||
        ! grep -q $'\e\[' "$work/tty.txt"; then
        cat "$work/tty.txt"; fail "$cmd, on a terminal: no tables drawn by rich"
    fi
    say "$cmd: drawn by rich on a terminal"
done
# A command that needs an extra names it.
rc=0
m maru-shm bench --only hybrid >/dev/null 2>"$work/extra.txt" || rc=$?
if [ "$rc" != 2 ] || ! grep -q "pip install 'maru-shm\[sglang\]'" "$work/extra.txt"; then
    cat "$work/extra.txt"; fail "bench without the sglang extra: exit $rc, not a message naming the extra"
fi
say "without the sglang extra: $(cat "$work/extra.txt")"
m maru-shm destroy "$pool"
[ ! -e "$pool" ] || fail "destroy left $pool"
say "ok: create, put/get, inspect (pipe, --json, terminal), watch (terminal), check, destroy from the wheel"
