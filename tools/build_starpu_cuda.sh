#!/usr/bin/env bash
# Builds StarPU with CUDA into .cuda/starpu (git-ignored); `make cuda` runs it.
#
# Debian's StarPU has no CUDA, and StarPU releases up to 1.4.12 predate the fix
# for CUDA 13, so the source is pinned to a commit of the starpu-1.4 branch:
#   STARPU_SOURCE=path/to/starpu-1.4-<commit>-autogen.tar.gz   (checked against its sha256)
#   STARPU_SOURCE=path/to/a/source/tree                         (used as it is)
#   unset: downloaded from GitHub at the pinned commit (needs network and autotools)
# then patched with tools/starpu-patches/*.patch (each says what it fixes and how it was found).
#
# StarPU-MPI is built with it (distributed training, docs/distributed.md) from the MPI whose mpicc is on
# PATH: Debian's Open MPI (openmpi-bin, libopenmpi-dev, as `make test` installs) where apt can install it.
# Without an MPI and a way to install one, StarPU is built without MPI, and the build says so.
#
# The CUDA toolkit is looked up in CUDA_HOME, CUDA_PATH, /usr/local/cuda and
# /usr/local/cuda-*, then next to `nvcc` on PATH. What a toolkit lacks (cuBLAS,
# and the cuSPARSE/cuSOLVER headers that starpu.h includes) comes from NVIDIA's
# PyPI wheels, and .cuda/toolkit becomes one folder of links that looks like a
# whole toolkit. Without nvcc, or without network when a piece is missing, it
# stops and says which piece and where it looked.
set -euo pipefail

STARPU_COMMIT=a67e552b3d7368262f9d748d2b756609fbf8f974
STARPU_TARBALL_SHA256=0f8297265d08073bf7f5f60d4092dddcba86fed54b000fc791223b42b8e0a603
STARPU_URL=https://github.com/starpu-runtime/starpu/archive/$STARPU_COMMIT.tar.gz
# Wheels for CUDA 13 toolkits without cuBLAS (pinned to what was measured to work).
CU13_WHEELS=(nvidia-cublas==13.0.2.14 nvidia-cusparse==12.6.3.3 nvidia-cusolver==12.0.4.66)
CU12_WHEELS=(nvidia-cublas-cu12 nvidia-cusparse-cu12 nvidia-cusolver-cu12)

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(realpath -m "${JNNTILE_CUDA_DIR:-$ROOT/.cuda}")  # absolute: GIT_CEILING_DIRECTORIES below needs it
PATCHES=("$ROOT"/tools/starpu-patches/*.patch)
[ -e "${PATCHES[0]}" ] || PATCHES=()
PREFIX=$WORK/starpu
TOOLKIT=$WORK/toolkit
PYTHON=${PYTHON:-python3}
JOBS=$(nproc 2>/dev/null || echo 2)

die() { echo "make cuda: $*" >&2; exit 1; }
log() { echo "make cuda: $*" >&2; }

# ---- build dependencies ---------------------------------------------------------------------

# hwloc (StarPU), pkg-config, patch (or git) and OpenBLAS (this project): from apt where they are
# missing and apt can install them; a GPU machine without network has them already.
ensure_build_packages() {
  local missing=()
  command -v pkg-config >/dev/null || missing+=(pkg-config)
  command -v patch >/dev/null || command -v git >/dev/null || missing+=(patch)
  pkg-config --exists hwloc 2>/dev/null || missing+=(libhwloc-dev)
  # (not `ls | grep`: under pipefail, ls's complaint about the patterns that match nothing fails the test)
  [ -n "$(ls /usr/include/cblas.h /usr/include/*/cblas.h /usr/include/*/*/cblas.h 2>/dev/null)" ] \
    || missing+=(libopenblas-dev)
  [ ${#missing[@]} -eq 0 ] && return
  apt_install "${missing[@]}" \
    || die "could not install ${missing[*]}: install them (Debian/Ubuntu package names) and run make cuda again"
}

apt_install() {
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  log "installing $* with apt-get"
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@"
}

has_mpi() { command -v mpicc >/dev/null && command -v mpirun >/dev/null && echo '#include <mpi.h>' | mpicc -x c -E - >/dev/null 2>&1; }

# "enable" when an MPI is there or could be installed, else "disable" (StarPU-MPI is what distributed
# training needs, not what a single GPU does: its absence is said, not fatal).
mpi_choice() {
  if has_mpi || { command -v apt-get >/dev/null && apt_install openmpi-bin libopenmpi-dev >&2 && has_mpi; }; then
    echo enable
    return
  fi
  log "WARNING: no MPI (mpicc, mpirun and mpi.h): StarPU is built without StarPU-MPI, so this build has no
distributed training. Install Open MPI (apt-get install openmpi-bin libopenmpi-dev) and run make cuda again."
  echo disable
}

# ---- the CUDA toolkit ----------------------------------------------------------------------

has_cudart() { [ -e "$1/lib64/libcudart.so" ] || [ -e "$1/targets/x86_64-linux/lib/libcudart.so" ] \
  || [ -e "$1/targets/sbsa-linux/lib/libcudart.so" ]; }

find_toolkit() {
  local candidates=() dir
  [ -n "${CUDA_HOME:-}" ] && candidates+=("$CUDA_HOME")
  [ -n "${CUDA_PATH:-}" ] && candidates+=("$CUDA_PATH")
  candidates+=(/usr/local/cuda)
  for dir in $(ls -d /usr/local/cuda-* 2>/dev/null | sort -rV); do candidates+=("$dir"); done
  command -v nvcc >/dev/null && candidates+=("$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")")
  for dir in "${candidates[@]}"; do
    if [ -x "$dir/bin/nvcc" ] && [ -e "$dir/include/cuda_runtime.h" ] && has_cudart "$dir"; then
      readlink -f "$dir"
      return 0
    fi
  done
  die "no CUDA toolkit found: looked for bin/nvcc, include/cuda_runtime.h and libcudart.so in ${candidates[*]}.
Install the CUDA toolkit (nvcc and the runtime) or set CUDA_HOME to it. (PyPI's CUDA 12 wheels have no nvcc;
CUDA 13's nvidia-cuda-nvcc wheel does.)"
}

# The folder holding `file` under `root` (first match), or nothing.
find_dir_of() { find -L "$1" -name "$2" -print -quit 2>/dev/null | xargs -r dirname; }

# Downloads the wheels for this toolkit's major version into $WORK/wheels and
# unpacks their include/ and lib/ folders there.
fetch_wheels() {
  local major=$1; shift
  local wheels=()
  if [ "$major" = 13 ]; then wheels=("${CU13_WHEELS[@]}"); else wheels=("${CU12_WHEELS[@]}"); fi
  mkdir -p "$WORK/wheels"
  log "fetching ${wheels[*]} from PyPI (cuBLAS and headers this toolkit lacks)"
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$WORK/wheels" "${wheels[@]}" \
    || die "could not download ${wheels[*]} from PyPI; install cuBLAS into the toolkit or give network access"
  "$PYTHON" - "$WORK/wheels" <<'EOF'
import pathlib, sys, zipfile
folder = pathlib.Path(sys.argv[1])
for wheel in folder.glob("*.whl"):
    with zipfile.ZipFile(wheel) as z:
        # cuBLAS: headers and libraries; the others: headers only (starpu.h includes them).
        keep = ("/include/", "/lib/") if "cublas" in wheel.name else ("/include/",)
        z.extractall(folder / "unpacked", [n for n in z.namelist() if any(k in n for k in keep)])
    wheel.unlink()  # only what was unpacked is used
EOF
}

# .cuda/toolkit: the system toolkit itself when it is complete, else links to its
# pieces plus the wheels' cuBLAS and headers, laid out as configure expects.
assemble_toolkit() {
  local system=$1 version major inc lib cublas_inc cublas_lib
  version=$("$system/bin/nvcc" --version | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1.\2/p')
  major=${version%%.*}
  log "CUDA toolkit $version at $system"
  inc=$system/include
  lib=$system/lib64; [ -d "$lib" ] || lib=$(find_dir_of "$system/targets" libcudart.so)
  rm -rf "$TOOLKIT"
  if [ -e "$inc/cublas_v2.h" ] && [ -e "$lib/libcublas.so" ] && [ -e "$inc/cusparse.h" ] && [ -e "$inc/cusolverDn.h" ]; then
    ln -s "$system" "$TOOLKIT"
    return
  fi
  fetch_wheels "$major"
  cublas_inc=$(find_dir_of "$WORK/wheels/unpacked" cublas_v2.h)
  cublas_lib=$(find_dir_of "$WORK/wheels/unpacked" "libcublas.so.*")
  [ -n "$cublas_inc" ] && [ -n "$cublas_lib" ] || die "the cuBLAS wheel has no cublas_v2.h or libcublas.so.*"
  mkdir -p "$TOOLKIT/include" "$TOOLKIT/lib64" "$TOOLKIT/targets/x86_64-linux"
  ln -s "$system/bin" "$TOOLKIT/bin"
  [ -d "$system/nvvm" ] && ln -s "$system/nvvm" "$TOOLKIT/nvvm"
  local entry
  for entry in "$inc"/* "$WORK"/wheels/unpacked/nvidia/*/include/* "$WORK"/wheels/unpacked/nvidia/*/*/include/*; do
    [ -e "$entry" ] && ln -sfn "$entry" "$TOOLKIT/include/$(basename "$entry")"
  done
  for entry in "$lib"/* "$cublas_lib"/*; do
    [ -e "$entry" ] && ln -sfn "$entry" "$TOOLKIT/lib64/$(basename "$entry")"
  done
  # The wheel ships only libcublas.so.N; linkers and configure look for libcublas.so.
  for name in libcublas libcublasLt; do
    local versioned
    versioned=$(ls "$TOOLKIT/lib64/$name.so."* 2>/dev/null | head -n 1)
    [ -n "$versioned" ] && ln -sfn "$(basename "$versioned")" "$TOOLKIT/lib64/$name.so"
  done
  ln -s lib64 "$TOOLKIT/lib"
  ln -s ../../include "$TOOLKIT/targets/x86_64-linux/include"
  ln -s ../../lib64 "$TOOLKIT/targets/x86_64-linux/lib"
  [ -e "$TOOLKIT/include/cusparse.h" ] || die "no cusparse.h in the toolkit or the wheels (starpu.h includes it)"
}

# ---- StarPU ---------------------------------------------------------------------------------

# patch where installed, else git apply outside any repository (.cuda sits inside this one, and git apply run
# within a repository would skip paths outside the current folder without a word). A patch that a source tree
# (STARPU_SOURCE=dir) already holds is left as it is.
apply_patch() {
  local patch=$1 src=$2
  if command -v patch >/dev/null; then
    if patch -s -p1 -R -f --dry-run -d "$src" < "$patch" >/dev/null 2>&1; then
      log "$(basename "$patch") is already applied"
      return
    fi
    patch -s -p1 -f -d "$src" < "$patch"
  else
    if (cd "$src" && GIT_CEILING_DIRECTORIES=$(dirname "$src") git apply -p1 -R --check "$patch" 2>/dev/null); then
      log "$(basename "$patch") is already applied"
      return
    fi
    (cd "$src" && GIT_CEILING_DIRECTORIES=$(dirname "$src") git apply -p1 "$patch")
  fi
}

unpack_source() {
  local src=$WORK/src/starpu
  rm -rf "$WORK/src"
  mkdir -p "$src"
  if [ -n "${STARPU_SOURCE:-}" ] && [ -d "$STARPU_SOURCE" ]; then
    log "StarPU source tree $STARPU_SOURCE"
    cp -a "$STARPU_SOURCE/." "$src/"
  else
    local tarball=${STARPU_SOURCE:-}
    if [ -z "$tarball" ]; then
      tarball=$WORK/starpu-$STARPU_COMMIT.tar.gz
      log "downloading StarPU $STARPU_COMMIT from GitHub (set STARPU_SOURCE=tarball where there is no network)"
      curl -fsSL -o "$tarball" "$STARPU_URL" || die "could not download $STARPU_URL; set STARPU_SOURCE to the tarball"
      local commit
      commit=$(gzip -dc "$tarball" | git get-tar-commit-id 2>/dev/null || true)
      [ "$commit" = "$STARPU_COMMIT" ] || die "$STARPU_URL holds commit '$commit', expected $STARPU_COMMIT"
    else
      [ -f "$tarball" ] || die "STARPU_SOURCE=$tarball does not exist"
      local sum
      sum=$(sha256sum "$tarball" | cut -d' ' -f1)
      [ "$sum" = "$STARPU_TARBALL_SHA256" ] || die "STARPU_SOURCE=$tarball has sha256 $sum, expected $STARPU_TARBALL_SHA256
(the starpu-1.4 branch at $STARPU_COMMIT with ./autogen.sh run); give that tarball or a source tree"
    fi
    tar -xzf "$tarball" -C "$src" --strip-components=1
  fi
  local patch
  for patch in "${PATCHES[@]}"; do
    apply_patch "$patch" "$src" >&2 || die "could not apply $patch to the StarPU source in $src"
  done
  if [ ! -x "$src/configure" ]; then
    command -v autoreconf >/dev/null && command -v libtoolize >/dev/null \
      || die "the StarPU source has no configure script and autotools are missing: apt-get install autoconf automake libtool"
    (cd "$src" && ./autogen.sh >/dev/null)
  fi
  echo "$src"
}

# StarPU's configure arguments, one a line; $1: enable or disable (MPI). The stamp holds their digest.
# --enable-maxcpus: the GPU machines have more cores than Debian's limit of 4. --disable-build-tests and
# --disable-build-examples leave out StarPU-MPI's too.
configure_args() {
  printf '%s\n' --prefix="$PREFIX" --enable-maxcpus=64 --enable-maxcudadev=8 \
    --with-cuda-dir="$TOOLKIT" --with-cuda-include-dir="$TOOLKIT/include" --with-cuda-lib-dir="$TOOLKIT/lib64" \
    --with-cublas-dir="$TOOLKIT" --with-cublas-include-dir="$TOOLKIT/include" --with-cublas-lib-dir="$TOOLKIT/lib64" \
    --disable-opencl --"$1"-mpi --disable-fortran --disable-build-doc --disable-build-examples \
    --disable-build-tests --disable-starpupy --disable-socl --disable-starpufft --disable-openmp --disable-fxt \
    NVCC="$TOOLKIT/bin/nvcc" CPPFLAGS=-DDISABLE_CUSPARSE_DEPRECATED LDFLAGS="-Wl,-rpath,$TOOLKIT/lib64"
}

build_starpu() {
  local mpi=$1 src build args
  src=$(unpack_source)
  build=$WORK/src/build
  mkdir -p "$build"
  mapfile -t args < <(configure_args "$mpi")
  log "configuring StarPU (about 20 s)"
  (cd "$build" && "$src/configure" -q "${args[@]}" > "$WORK/configure.log" 2>&1) \
    || die "StarPU's configure failed; see $WORK/configure.log"
  grep -q "define STARPU_USE_CUDA 1" "$build/src/common/config.h" "$build/include/starpu_config.h" 2>/dev/null \
    || die "StarPU configured without CUDA (see 'CUDA' in $WORK/configure.log)"
  [ "$mpi" = disable ] || grep -q "define STARPU_USE_MPI 1" "$build/src/common/config.h" "$build/include/starpu_config.h" \
    || die "StarPU configured without MPI although mpicc is $(command -v mpicc) (see 'MPI' in $WORK/configure.log)"
  log "building StarPU with $JOBS jobs (about 45 s on 16 cores, 100 s on 2)"
  # The old installation goes first: one built with MPI would leave StarPU-MPI beside a StarPU without it.
  (cd "$build" && make -j"$JOBS" > "$WORK/make.log" 2>&1 && rm -rf "$PREFIX" && make install > "$WORK/install.log" 2>&1) \
    || die "StarPU failed to build; see $WORK/make.log"
  rm -rf "$WORK/src"
}

main() {
  mkdir -p "$WORK"
  local system mpi stamp_want
  system=$(find_toolkit)
  mpi=$(mpi_choice)
  # The patches and configure's arguments are part of the build: a change rebuilds StarPU.
  stamp_want="$STARPU_COMMIT $system $(configure_args "$mpi" | cat "${PATCHES[@]}" - | sha256sum | cut -d' ' -f1)"
  if [ -f "$WORK/starpu.stamp" ] && [ "$(cat "$WORK/starpu.stamp")" = "$stamp_want" ] && [ -e "$TOOLKIT/bin/nvcc" ] \
     && [ -e "$PREFIX/lib/pkgconfig/starpu-1.4.pc" ]; then
    log "StarPU with CUDA is up to date in $PREFIX"
    return
  fi
  rm -f "$WORK/starpu.stamp"
  ensure_build_packages
  assemble_toolkit "$system"
  build_starpu "$mpi"
  echo "$stamp_want" > "$WORK/starpu.stamp"
  log "StarPU with CUDA installed in $PREFIX (toolkit: $TOOLKIT)"
}

main "$@"
