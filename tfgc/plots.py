"""Plots as SVG text, with nothing to install: the demo's and the benchmarks' figures.

``svg_plot`` draws lines of (x, y) points with a legend, on a linear or log-10 x axis
and a y axis between 0 and 1 (accuracies, fractions). Browsers and GitHub show the
files as they are.
"""

import math
from xml.sax.saxutils import escape

__all__ = ["COLORS", "DASHES", "fmt_bytes", "svg_plot"]


def fmt_bytes(b):
    """Bytes in GB, MB, KB (powers of 1000) with three significant digits."""
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return "–"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{int(b)} B"

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf"]
DASHES = ["", "7,3", "2,2"]


def _nice_ticks(lo, hi, count=6):
    span = hi - lo
    if span <= 0:
        return [lo]
    raw = span / count
    exp = 10 ** math.floor(math.log10(raw))
    step = next(m * exp for m in (1, 2, 2.5, 5, 10) if m * exp >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks, v = [], first
    while v <= hi + 1e-9 * span:
        ticks.append(round(v, 10))
        v += step
    return ticks


def svg_plot(title, xlabel, ylabel, series, xlog=False):
    """A line plot as SVG text: one line per (label, points), legend on the right."""
    x0, y0, w, h = 80, 40, 600, 420
    width, height = 900, y0 + h + 70
    xs = [x for _, pts in series for x, _ in pts]
    ys = [y for _, pts in series for _, y in pts]
    if xlog:
        xlo = 10 ** math.floor(math.log10(min(xs)))
        xhi = 10 ** math.ceil(math.log10(max(xs)))
        if xhi <= xlo:
            xhi = xlo * 10
    else:
        xlo, xhi = 0.0, max(xs) * 1.05 if max(xs) > 0 else 1.0
    ylo = max(0.0, math.floor(min(ys) * 10) / 10)
    yhi = min(1.0, math.ceil(max(ys) * 10) / 10)
    if yhi - ylo < 0.1:
        ylo, yhi = max(0.0, yhi - 0.1), max(yhi, ylo + 0.1)

    def px(x):
        t = ((math.log10(x) - math.log10(xlo)) / (math.log10(xhi) - math.log10(xlo))
             if xlog else (x - xlo) / (xhi - xlo))
        return x0 + w * t

    def py(y):
        return y0 + h * (1 - (y - ylo) / (yhi - ylo))

    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         'font-family="sans-serif" font-size="12">',
         f'<rect width="{width}" height="{height}" fill="white"/>',
         f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#333"/>']
    if xlog:
        xticks = []
        e = round(math.log10(xlo))
        while 10 ** e <= xhi * 1.0001:
            xticks.append((10 ** e, fmt_bytes(10 ** e)))
            e += 1
    else:
        xticks = [(v, f"{v:g}") for v in _nice_ticks(xlo, xhi)]
    for v, text in xticks:
        x = px(v)
        o.append(f'<line x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y0 + h}" stroke="#ddd"/>')
        o.append(f'<text x="{x:.1f}" y="{y0 + h + 16}" text-anchor="middle">{escape(text)}</text>')
    for v in _nice_ticks(ylo, yhi, 8):
        y = py(v)
        o.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + w}" y2="{y:.1f}" stroke="#ddd"/>')
        o.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">{v:g}</text>')
    o.append(f'<text x="{x0 + w / 2}" y="{y0 - 14}" text-anchor="middle" font-weight="bold">'
             f'{escape(title)}</text>')
    o.append(f'<text x="{x0 + w / 2}" y="{y0 + h + 40}" text-anchor="middle">'
             f'{escape(xlabel)}</text>')
    cy = y0 + h / 2
    o.append(f'<text x="{x0 - 50}" y="{cy}" text-anchor="middle" '
             f'transform="rotate(-90 {x0 - 50} {cy})">{escape(ylabel)}</text>')
    for i, (label, pts) in enumerate(series):
        color, dash = COLORS[i % len(COLORS)], DASHES[(i // len(COLORS)) % len(DASHES)]
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        p = [(px(x), py(y)) for x, y in pts]
        if len(p) > 1:
            d = " ".join(f"{x:.1f},{y:.1f}" for x, y in p)
            o.append(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="1.8"'
                     f'{dash_attr}/>')
        for x, y in p:
            o.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.8" fill="{color}"/>')
        ly = y0 + 8 + 18 * i
        o.append(f'<line x1="{x0 + w + 20}" y1="{ly}" x2="{x0 + w + 50}" y2="{ly}" '
                 f'stroke="{color}" stroke-width="2"{dash_attr}/>')
        o.append(f'<text x="{x0 + w + 56}" y="{ly + 4}">{escape(label)}</text>')
    o += ["</svg>", ""]
    return "\n".join(o)
