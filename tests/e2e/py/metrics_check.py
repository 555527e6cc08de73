"""Fetches a Prometheus /metrics page and parses it with prometheus_client's own parser.

Usage: metrics_check.py URL
Prints one JSON object: {"families": [{"name", "type", "help", "samples": [{"name", "labels",
"value"}]}]}. Exits 1 if the page cannot be fetched, is not the text exposition format, or does
not parse.
"""

import json
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def main():
    url = sys.argv[1]
    with urllib.request.urlopen(url, timeout=10) as r:
        if r.status != 200:
            sys.exit(f"metrics_check: {url}: HTTP {r.status}")
        ctype = r.headers.get("Content-Type", "")
        body = r.read().decode("utf-8")
    if not ctype.startswith("text/plain"):
        sys.exit(f"metrics_check: {url}: Content-Type {ctype!r} is not the text exposition format")
    families = []
    for fam in text_string_to_metric_families(body):
        families.append({
            "name": fam.name,
            "type": fam.type,
            "help": fam.documentation,
            "samples": [
                {"name": s.name, "labels": dict(s.labels), "value": s.value} for s in fam.samples
            ],
        })
    print(json.dumps({"families": families}))


if __name__ == "__main__":
    main()
