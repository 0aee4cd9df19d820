#!/usr/bin/env bash
# Issue 15 parts 4-6 in one device call: notebooks/04_gpu.ipynb executed with its outputs, a trace
# of the whole nano-vLLM benchmark at `blocks` level, and the live dashboard's overhead.
#   bash tools/gpu_notebooks.sh wheels                      (here, with pip's index: fills .whl/)
#   bash tools/gpu_notebooks.sh [notebook] [trace] [dashboard]   (default: all three; results in $OUT)
# The device has no package index: carry .whl (the notebook extras, nbclient and ipykernel for
# CPython 3.12, about 27 MB). Each part has its own time limit and writes its results as soon as
# they exist; the three stay within 9 minutes. Seven files come back: gpu.txt (machine, versions,
# pip check, each part's time), 04_gpu.ipynb with notebook.log, and a .json and .log per benchmark. Without CUDA every part runs on the CPU
# with small sizes (a dry run of the script).
parts=("$@")
if [[ ${#parts[@]} -eq 0 ]]; then parts=(notebook trace dashboard); fi
cd "$(dirname "$0")/.."
if [[ "${parts[0]}" == wheels ]]; then
    exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
        anywidget==0.11.0 asttokens==3.0.2 comm==0.2.3 debugpy==1.8.22 executing==2.3.0 fastjsonschema==2.22.3 \
        ipykernel==7.4.0 ipython==9.18.1 ipython_pygments_lexers==1.1.1 ipywidgets==8.1.9 jedi==0.20.1 \
        jsonschema==4.26.0 jsonschema-specifications==2025.9.1 jupyter_client==8.10.0 jupyter_core==5.9.1 \
        jupyterlab_widgets==3.0.17 matplotlib-inline==0.2.2 nbclient==0.11.0 nbformat==5.11.1 nest-asyncio2==1.7.4 \
        parso==0.8.7 pexpect==4.9.0 platformdirs==4.14.9 plotly==7.1.0 prompt_toolkit==3.0.53 psygnal==0.16.1 \
        ptyprocess==0.7.0 pure_eval==0.2.4 pyzmq==27.3.0 referencing==0.37.0 rpds-py==2026.9.1 stack-data==0.6.3 \
        tornado==6.6.1 traitlets==5.16.1 wcwidth==0.9.4 widgetsnbextension==4.0.16
fi
source tools/gpu_env.sh
if ! python3 -c "import anywidget, ipykernel, ipywidgets, nbclient, plotly" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PYTHONPATH
    python3 -c "import anywidget, ipykernel, ipywidgets, nbclient, plotly" || exit 1
    python3 -m pip check >> "$OUT/gpu.txt" 2>&1  # a wheel's requirement the image's versions miss shows here
fi
python3 -m ipykernel install --prefix /tmp/jup --name python3 >/dev/null 2>&1 || exit 1
export JUPYTER_PATH=/tmp/jup/share/jupyter
device="${KVSCOPE_DEVICE:-$(python3 -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')}"
if [[ "$device" == cuda ]]; then
    model=(--device cuda --config benchmarks/configs/qwen3-0.6b --requests 256)
    small=()
else
    model=(--device cpu --config assets/kvscope-demo --requests 8)
    small=(--max-input 128 --max-output 128)
fi
echo "device $device; parts: ${parts[*]}" | tee -a "$OUT/gpu.txt"
rc=0
for part in "${parts[@]}"; do
    start=$SECONDS
    case "$part" in
    notebook)  # SIGINT: nbclient stops and the notebook is written with the outputs it has
        timeout -s INT -k 15 200 python3 - notebooks/04_gpu.ipynb "$OUT/04_gpu.ipynb" <<'EOF' 2>&1 | tee "$OUT/notebook.log" || rc=1
import sys
import nbclient
import nbformat

src, dst = sys.argv[1:3]
book = nbformat.read(src, as_version=4)
client = nbclient.NotebookClient(book, timeout=180, kernel_name="python3", resources={"metadata": {"path": "notebooks"}})
try:
    client.execute()
finally:
    nbformat.write(book, dst)
    for i, cell in enumerate(book.cells):
        for out in cell.get("outputs", []):
            text = out.get("text") or out.get("data", {}).get("text/plain") or f"{out.get('ename')}: {out.get('evalue')}"
            print(f"[cell {i}] {text}".rstrip())
EOF
        ;;
    trace)
        timeout 160 python3 benchmarks/bench_trace_scale.py "${model[@]}" "${small[@]}" --json "$OUT/trace_scale.json" \
            2>&1 | tee "$OUT/trace_scale.log" || rc=1
        ;;
    dashboard)
        timeout 170 python3 benchmarks/bench_dashboard_overhead.py "${model[@]}" "${small[@]}" --num-kv-blocks 0 \
            --budget 16384 --max-seqs 256 --async-scheduling --arms none,dashboard --rounds 4 \
            --json "$OUT/dashboard_overhead.json" 2>&1 | tee "$OUT/dashboard_overhead.log" || rc=1
        ;;
    *)
        echo "unknown part $part (wheels, notebook, trace, dashboard)"; exit 2
        ;;
    esac
    echo "$part: $((SECONDS - start)) s" | tee -a "$OUT/gpu.txt"
done
exit $rc
