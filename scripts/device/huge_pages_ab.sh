#!/usr/bin/env bash
# The CPU KV pool on 2 MiB against 4 KiB pages (HERALD_HUGE_PAGES=1 / 0), alternated in one call:
# scripts/device/switch_ab.sh with AB_VAR=HERALD_HUGE_PAGES (default SIDES "1 0 1 0"; folders
# <value>_<n>/ and the table in $OUT/switch_ab.txt, results/offload/huge_pages/README.md).
#
#   SIDES="0 1 0" bash scripts/device/huge_pages_ab.sh
AB_VAR=HERALD_HUGE_PAGES SIDES=${SIDES:-1 0 1 0} exec bash "$(dirname "$0")/switch_ab.sh"
