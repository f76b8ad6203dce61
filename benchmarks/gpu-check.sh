#!/usr/bin/env bash
# The GPU check in one command: the CUDA tests, then the layer, host and inference sections and the
# compiled decoding benchmark on one GPU, written to benchmarks/results-gpu.md. Every step has a time
# limit: under 8 minutes in all.
#
#   bash benchmarks/gpu-check.sh            # from anywhere; runs in the repository root
#   PYTHON=/path/to/python bash benchmarks/gpu-check.sh
#
# What it assumes (see benchmarks/README.md): a Python with a CUDA build of torch that sees a GPU
# ($PYTHON, else .venv/bin/python, else python3), and the library's dependencies, pytest and hypothesis.
# Missing ones are installed, without their dependencies, from wheels in .whl/ (a machine that reaches
# no registry), else from the registry when it can be reached; otherwise it stops and names them. The
# repository is used as it is (on PYTHONPATH), not installed. It exits non-zero when a step failed, and
# writes what every step did to the end of results-gpu.md.
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
RESULTS=benchmarks/results-gpu.md
LOGS=${GPU_CHECK_LOGS:-$(mktemp -d /tmp/mumoe-gpu-check-XXXXXX)}
SITE=${GPU_CHECK_SITE:-/tmp/mumoe-gpu-site}
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}

if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x .venv/bin/python ] && .venv/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    PY=.venv/bin/python
else
    PY=python3
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu-check: $PY has no CUDA build of torch that sees a GPU (torch.cuda.is_available() is False)" >&2
    exit 2
fi

# Packages the library, its tests and the benchmarks import: import name, then distribution name.
NEEDED="numpy:numpy opt_einsum:opt_einsum entmax:entmax tensorly:tensorly tltorch:tensorly-torch networkx:networkx
rich:rich tqdm:tqdm matplotlib:matplotlib pytest:pytest hypothesis:hypothesis"
missing() {
    for pair in $NEEDED; do
        PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "import ${pair%%:*}" 2>/dev/null || printf '%s ' "${pair#*:}"
    done
}
wanted=$(missing)
if [ -n "$wanted" ]; then
    mkdir -p "$SITE"
    if compgen -G ".whl/*.whl" >/dev/null; then
        echo "gpu-check: installing $wanted from .whl/ into $SITE"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
    else
        echo "gpu-check: installing $wanted from the registry into $SITE"
        # shellcheck disable=SC2086  # one argument per package
        "$PY" -m pip install -q --no-deps --timeout 10 --retries 0 --target "$SITE" $wanted
    fi
    wanted=$(missing)
    if [ -n "$wanted" ]; then
        echo "gpu-check: still missing: $wanted. Carry their wheels in .whl/ (benchmarks/README.md)." >&2
        exit 3
    fi
fi
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"

status=0
declare -a steps
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $LOGS/NAME.log, record the outcome
    local name=$1 limit=$2 start code
    shift 2
    start=$(date +%s)
    echo "gpu-check: $name (at most ${limit} s)"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
    code=${PIPESTATUS[0]}
    local outcome="passed"
    [ "$code" -eq 124 ] && outcome="stopped at its ${limit} s limit"
    [ "$code" -ne 0 ] && [ "$code" -ne 124 ] && outcome="failed (exit $code)"
    [ "$code" -ne 0 ] && status=1
    steps+=("| $name | \`$*\` | $(($(date +%s) - start)) s | $outcome |")
}

# The CUDA tests: every test whose id names CUDA, in every test file that mentions it.
mapfile -t files < <(grep -rl --include="test_*.py" "cuda" tests | sort)
step tests 90 "$PY" -m pytest -q -p no:cacheprovider -k cuda "${files[@]}"
tests_summary=$(grep -E "passed|failed|error|no tests ran" "$LOGS/tests.log" | tail -1)

step benchmarks 230 "$PY" -m benchmarks.run --device cuda --only layer host inference --no-docs --no-compile
step compiled 140 "$PY" -m benchmarks.compiled --batch 1 --calls 100

# Drop the part an earlier check appended (a run that failed before rewriting the page leaves it there).
"$PY" -c 'import pathlib, sys
page = pathlib.Path(sys.argv[1])
text = page.read_text() if page.exists() else "# mumoe_tn benchmarks\n"
page.write_text(text.split("\n## GPU check\n")[0].rstrip("\n") + "\n")' "$RESULTS"
{
    echo
    echo "## GPU check"
    echo
    echo "\`bash benchmarks/gpu-check.sh\` on $("$PY" -c "import torch; print(torch.cuda.get_device_name())"),"\
         "torch $("$PY" -c "import torch; print(torch.__version__)"), $(date -u +"%Y-%m-%d %H:%M UTC")."
    echo
    echo "CUDA tests: ${tests_summary:-no summary line (see the log)}."
    echo
    echo "| step | command | time | outcome |"
    echo "|---|---|---:|---|"
    printf '%s\n' "${steps[@]}"
    echo
    echo "### Decoding under torch.compile (\`python -m benchmarks.compiled --batch 1 --calls 100\`)"
    echo
    grep -E "^\||^NVIDIA|torch " "$LOGS/compiled.log" || echo "(no table: see the step's outcome)"
} >>"$RESULTS"
echo "gpu-check: wrote $RESULTS; logs in $LOGS"
exit $status
