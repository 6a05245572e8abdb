#!/usr/bin/env bash
# Checks a `cube bench --report DIR` page the way a reader sees it: headless Chromium
# renders DIR/index.html (offline: no network, a fresh profile), its screenshot must
# have the window's size and real content, and in the rendered DOM every chart
# (<figure class="chart">) must be drawn, with data elements (lines, points, bars)
# besides its axes. Exits 2 when Chromium is missing (scripts/setup.sh installs it).
set -euo pipefail

dir="${1:?usage: check-report.sh DIR}"
page="$dir/index.html"
[ -f "$page" ] || { echo "check-report: $page is missing" >&2; exit 1; }
chromium="$(command -v chromium || command -v chromium-browser || true)"
if [ -z "$chromium" ]; then
    echo "check-report: no chromium (apt-get install chromium)" >&2
    exit 2
fi
width=1000
height=3200
profile="$(mktemp -d /tmp/cube-report-chromium.XXXXXX)"
trap 'rm -rf "$profile"' EXIT
flags=(--headless --no-sandbox --disable-gpu --disable-quic --no-first-run
    --disable-background-networking --disable-component-update --disable-sync
    --user-data-dir="$profile" --window-size="$width,$height")
url="file://$(cd "$(dirname "$page")" && pwd)/$(basename "$page")"
timeout 120 "$chromium" "${flags[@]}" --screenshot="$dir/screenshot.png" "$url" 2>/dev/null
timeout 120 "$chromium" "${flags[@]}" --dump-dom "$url" >"$dir/dom.html" 2>/dev/null

python3 - "$dir/screenshot.png" "$dir/dom.html" "$width" "$height" <<'EOF'
import re
import struct
import sys

png, dom, width, height = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
data = open(png, "rb").read()
if data[:8] != b"\x89PNG\r\n\x1a\n":
    sys.exit(f"check-report: {png} is not a PNG")
w, h = struct.unpack(">II", data[16:24])
if (w, h) != (width, height):
    sys.exit(f"check-report: screenshot is {w}x{h}, not {width}x{height}")
# A blank page compresses to a few KiB; five charts with text do not.
if len(data) < 40_000:
    sys.exit(f"check-report: screenshot holds {len(data)} bytes: too little drawn")

html = open(dom, encoding="utf-8").read()
figures = re.findall(r'<figure class="(chart[^"]*)" id="([^"]+)">(.*?)</figure>', html, re.S)
if len(figures) < 5:
    sys.exit(f"check-report: {len(figures)} charts in the page, expected 5")
failed = []
for cls, ident, body in figures:
    if "missing" in cls:
        failed.append(f"{ident}: no data")
        continue
    # Data points are drawn as circles (on every line), bars as rects; axes and
    # legend lines are polylines too, and four rects at most are the background and
    # the legend's frame and keys.
    points = len(re.findall(r"<circle", body))
    rects = len(re.findall(r"<rect", body))
    drawn = points + max(0, rects - 4)
    if drawn == 0:
        failed.append(f"{ident}: nothing drawn ({points} points, {rects} rects)")
    else:
        print(f"check-report: {ident}: {points} points, {rects} rects")
if failed:
    sys.exit("check-report: " + "; ".join(failed))
print(f"check-report: {len(figures)} charts drawn, screenshot {w}x{h}, {len(data)} bytes")
EOF
