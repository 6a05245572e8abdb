#!/usr/bin/env python3
"""Prints the targets of a `cube bench --json` report, one line each, met or MISSED."""
import json
import sys

report = json.load(open(sys.argv[1]))
for key in sys.argv[2:]:
    print(f"{key:<48} {report.get(key)}")
for t in report.get("targets", []):
    state = "met" if t["met"] else "MISSED"
    print(f'{t["name"]:<48} {t["value"]:>10} (limit {t["limit"]}) {state}')
