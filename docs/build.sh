#!/usr/bin/env bash
# Build the documentation: the quick benchmark's plot, the HTML pages and the tutorials' doctests,
# warnings as errors. Needs `pip install -e ".[torch,docs]"`. Output: docs/_build/html.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p docs/_static
python -m spchain bench --quick --png docs/_static/bench.png
sphinx-build -W --keep-going -q -b html docs docs/_build/html
sphinx-build -W --keep-going -q -b doctest docs docs/_build/doctest
