"""Plots as SVG text, with nothing to install: the demo's and the benchmarks' figures.

``svg_plot`` draws lines of (x, y) points with a legend, on a linear or log-10 x axis
and a y axis between 0 and 1 (accuracies, fractions). Browsers and GitHub show the
files as they are.
"""

import math
from xml.sax.saxutils import escape

__all__ = ["COLORS", "DASHES", "Panel", "fmt_bytes", "svg_plot"]


def fmt_bytes(b, exact=False):
    """Bytes in GB, MB, kB (powers of 1000) with three significant digits; "–" for none.

    The project's one byte formatter (the demo, the benchmarks' tables and figures).
    ``exact=True`` gives the whole count with thousands separators and no unit, for
    tables whose header names it.
    """
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return "–"
    if exact:
        return f"{int(b):,}"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
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


class Panel:
    """A plot area with linear or log axes, drawing into ``out``, a list of SVG elements.

    The project's one plotter: ``svg_plot`` below and the network benchmark's report
    draw with it. ``style`` sets the offsets of the title and axis labels, the line
    width and the point radius.
    """

    STYLE = {"title_dy": 10, "xlabel_dy": 36, "ylabel_dx": 58, "line_width": 2,
             "radius": 3.5, "point_stroke": True}

    def __init__(self, out, x0, y0, w, h, xlim, ylim, xlog=False, ylog=False, **style):
        self.out, self.x0, self.y0, self.w, self.h = out, x0, y0, w, h
        self.xlim, self.ylim, self.xlog, self.ylog = xlim, ylim, xlog, ylog
        unknown = set(style) - set(self.STYLE)
        if unknown:
            raise ValueError(f"unknown style {sorted(unknown)}; known: {sorted(self.STYLE)}")
        self.style = dict(self.STYLE, **style)

    def _t(self, v, lim, log):
        lo, hi = lim
        if log:
            v, lo, hi = math.log10(v), math.log10(lo), math.log10(hi)
        return (v - lo) / (hi - lo) if hi != lo else 0.5

    def px(self, x):
        return self.x0 + self.w * self._t(x, self.xlim, self.xlog)

    def py(self, y):
        return self.y0 + self.h * (1 - self._t(y, self.ylim, self.ylog))

    def frame(self, title, xlabel, ylabel, xticks, yticks):
        """The box, the grid lines at ``xticks`` and ``yticks`` ([(value, text)]), the
        title and the axis labels."""
        o, st = self.out, self.style
        o.append(f'<rect x="{self.x0}" y="{self.y0}" width="{self.w}" height="{self.h}" '
                 'fill="none" stroke="#333"/>')
        for v, text in xticks:
            x = self.px(v)
            o.append(f'<line x1="{x:.1f}" y1="{self.y0}" x2="{x:.1f}" y2="{self.y0 + self.h}" '
                     'stroke="#ddd"/>')
            o.append(f'<text x="{x:.1f}" y="{self.y0 + self.h + 16}" text-anchor="middle">'
                     f'{escape(text)}</text>')
        for v, text in yticks:
            y = self.py(v)
            o.append(f'<line x1="{self.x0}" y1="{y:.1f}" x2="{self.x0 + self.w}" y2="{y:.1f}" '
                     'stroke="#ddd"/>')
            o.append(f'<text x="{self.x0 - 6}" y="{y + 4:.1f}" text-anchor="end">'
                     f'{escape(text)}</text>')
        o.append(f'<text x="{self.x0 + self.w / 2}" y="{self.y0 - st["title_dy"]}" '
                 f'text-anchor="middle" font-weight="bold">{escape(title)}</text>')
        o.append(f'<text x="{self.x0 + self.w / 2}" y="{self.y0 + self.h + st["xlabel_dy"]}" '
                 f'text-anchor="middle">{escape(xlabel)}</text>')
        cy, lx = self.y0 + self.h / 2, self.x0 - st["ylabel_dx"]
        o.append(f'<text x="{lx}" y="{cy}" text-anchor="middle" '
                 f'transform="rotate(-90 {lx} {cy})">{escape(ylabel)}</text>')

    def series(self, points, color, dash="", hollow=False, ringed=()):
        """A line through ``points``; the points whose index is in ``ringed`` get a grey ring."""
        st = self.style
        pts = [(self.px(x), self.py(y)) for x, y in points]
        for i in ringed:
            x, y = pts[i]
            self.out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="7.5" fill="none" '
                            'stroke="#888" stroke-width="1.5"/>')
        if len(pts) > 1:
            d = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
            o = (f'<polyline points="{d}" fill="none" stroke="{color}" '
                 f'stroke-width="{st["line_width"]}"')
            self.out.append(o + (f' stroke-dasharray="{dash}"' if dash else "") + "/>")
        for x, y in pts:
            fill = "white" if hollow else color
            ring = f' stroke="{color}" stroke-width="1.5"' if st["point_stroke"] else ""
            self.out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{st["radius"]}" '
                            f'fill="{fill}"{ring}/>')


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

    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         'font-family="sans-serif" font-size="12">',
         f'<rect width="{width}" height="{height}" fill="white"/>']
    panel = Panel(o, x0, y0, w, h, (xlo, xhi), (ylo, yhi), xlog=xlog, title_dy=14,
                  xlabel_dy=40, ylabel_dx=50, line_width=1.8, radius=2.8, point_stroke=False)
    if xlog:
        xticks = []
        e = round(math.log10(xlo))
        while 10 ** e <= xhi * 1.0001:
            xticks.append((10 ** e, fmt_bytes(10 ** e)))
            e += 1
    else:
        xticks = [(v, f"{v:g}") for v in _nice_ticks(xlo, xhi)]
    panel.frame(title, xlabel, ylabel, xticks, [(v, f"{v:g}") for v in _nice_ticks(ylo, yhi, 8)])
    for i, (label, pts) in enumerate(series):
        color, dash = COLORS[i % len(COLORS)], DASHES[(i // len(COLORS)) % len(DASHES)]
        panel.series(pts, color, dash)
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        ly = y0 + 8 + 18 * i
        o.append(f'<line x1="{x0 + w + 20}" y1="{ly}" x2="{x0 + w + 50}" y2="{ly}" '
                 f'stroke="{color}" stroke-width="2"{dash_attr}/>')
        o.append(f'<text x="{x0 + w + 56}" y="{ly + 4}">{escape(label)}</text>')
    o += ["</svg>", ""]
    return "\n".join(o)
