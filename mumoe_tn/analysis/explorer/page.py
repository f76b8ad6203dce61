"""The explorer's HTML page: the findings as inline JSON, rendered by an inline script; nothing from the network.

A Content-Security-Policy meta tag forbids every request (``default-src 'none'``): scripts and
styles are inline, images are drawn from inline pixel data. All text from the data (tokens,
names) is inserted as text nodes, never as markup.
"""

from __future__ import annotations

import html
import json

__all__ = ["render"]

STYLE = r"""
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d2733;background:#f3f5f8}
header{padding:12px 20px;background:#1f3b57;color:#fff}
header h1{font-size:19px;margin:0 0 2px}
header p{margin:0;color:#cfdbe8;font-size:13px}
nav.layers{display:flex;flex-wrap:wrap;gap:6px;padding:10px 20px 0}
nav.layers button{border:1px solid #b8c4d2;background:#fff;border-radius:14px;padding:3px 12px;font:inherit;cursor:pointer;max-width:100%;overflow-wrap:anywhere}
nav.layers button.on{background:#1f3b57;color:#fff;border-color:#1f3b57}
.layout{display:flex;gap:16px;padding:12px 20px 20px;align-items:flex-start}
aside{flex:0 0 290px;min-width:0;position:sticky;top:8px}
main{flex:1 1 auto;min-width:0}
.card{background:#fff;border:1px solid #d9e0e8;border-radius:8px;padding:12px 14px;margin:0 0 14px}
.card h2{font-size:16px;margin:0 0 8px}
.card h3{font-size:14px;margin:10px 0 6px}
.muted{color:#5d6b7a;font-size:12.5px}
.controls{display:flex;gap:6px;margin-bottom:8px}
.controls input,.controls select{font:inherit;min-width:0;flex:1 1 0;padding:4px 6px;border:1px solid #b8c4d2;border-radius:5px}
.unit-list{list-style:none;margin:0;padding:0;max-height:calc(100vh - 190px);overflow-y:auto;overflow-x:hidden;border-top:1px solid #e4e9ef}
.unit-list li{display:flex;align-items:center;gap:8px;padding:4px 6px;border-bottom:1px solid #eef1f5;cursor:pointer}
.unit-list li:hover{background:#eef4fa}
.unit-list li.on{background:#dbe9f6}
.unit-list .name{flex:0 0 64px;font-family:ui-monospace,monospace;overflow-wrap:anywhere}
.unit-list .meter{flex:1 1 auto;height:8px;background:#e6ebf1;border-radius:4px;min-width:20px}
.unit-list .meter span{display:block;height:8px;border-radius:4px;background:#2e86c1}
.unit-list .value{flex:0 0 70px;text-align:right;font-variant-numeric:tabular-nums;font-size:12px}
.unit-list li.dead .name{color:#b03a2e}
.stats{display:grid;grid-template-columns:repeat(auto-fill,minmax(132px,1fr));gap:8px}
.stat{background:#f6f8fb;border:1px solid #e4e9ef;border-radius:6px;padding:6px 8px;min-width:0}
.stat b{display:block;font-size:17px;overflow-wrap:anywhere}
.stat span{font-size:12px;color:#5d6b7a}
.warn{background:#fdf0ed;border:1px solid #f0b8ad;color:#8e2a1d;border-radius:6px;padding:8px 10px;margin:0 0 10px;overflow-wrap:anywhere}
.chart{display:block;width:100%;height:110px}
.axis{display:flex;justify-content:space-between;font-size:11.5px;color:#5d6b7a}
.grid2{display:grid;grid-template-columns:repeat(auto-fit,minmax(260px,1fr));gap:14px}
.grid2>div{min-width:0}
table{width:100%;border-collapse:collapse;table-layout:fixed;font-size:13px}
th,td{padding:3px 6px;border-bottom:1px solid #eef1f5;text-align:left;overflow-wrap:anywhere;vertical-align:top}
th{color:#5d6b7a;font-weight:600}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
.examples{display:flex;flex-direction:column;gap:6px}
.example{display:flex;gap:10px;align-items:flex-start;border-bottom:1px solid #eef1f5;padding:4px 0}
.example .where{flex:0 0 112px;font-size:12px;color:#5d6b7a}
.example .text{flex:1 1 auto;min-width:0;font-family:ui-monospace,"DejaVu Sans Mono",monospace;white-space:pre-wrap;overflow-wrap:anywhere;font-size:13px}
.tok{border-radius:3px}
.tok.centre{outline:2px solid #1f3b57;outline-offset:-1px}
.example .coef{flex:0 0 58px;text-align:right;font-variant-numeric:tabular-nums}
.images{display:grid;grid-template-columns:repeat(auto-fill,minmax(92px,1fr));gap:10px}
.images figure{margin:0;min-width:0;text-align:center;font-size:12px}
.images canvas{width:72px;height:72px;image-rendering:pixelated;border:1px solid #d9e0e8;display:block;margin:0 auto 2px}
.chips{display:flex;flex-wrap:wrap;gap:5px}
.chip{background:#eef4fa;border:1px solid #cfe0ef;border-radius:11px;padding:1px 8px;font-size:12.5px;max-width:100%;overflow-wrap:anywhere}
.chip code{font-family:ui-monospace,monospace;white-space:pre-wrap}
.chip.neg{background:#fdf0ed;border-color:#f0cfc7}
.heat{display:block;width:100%;max-width:520px;height:auto}
.legend{display:flex;gap:12px;flex-wrap:wrap;font-size:12px;color:#5d6b7a;margin-top:4px}
.legend i{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:4px;vertical-align:-1px}
a.back{color:#1f5f8b;cursor:pointer;text-decoration:underline}
@media (max-width:900px){.layout{flex-direction:column}aside{position:static;flex:none;width:100%}.unit-list{max-height:230px}}
"""

SCRIPT = r"""
"use strict";
const D = JSON.parse(document.getElementById("explorer-data").textContent);
const state = {layer: 0, unit: null, sort: "load", query: ""};
const SVG = "http://www.w3.org/2000/svg";

function h(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "onclick" || key === "oninput" || key === "onchange") node[key] = value;
    else if (value !== null && value !== undefined && value !== false) node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.appendChild(typeof child === "string" || typeof child === "number" ? document.createTextNode(String(child)) : child);
  }
  return node;
}
function s(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  for (const child of children) if (child) node.appendChild(child);
  return node;
}
function fmt(value, digits) {
  if (value === null || value === undefined) return "–";
  if (typeof value !== "number") return String(value);
  const d = digits || 3;
  if (value !== 0 && (Math.abs(value) < 1e-3 || Math.abs(value) >= 1e5)) return value.toExponential(d - 1);
  return String(Number(value.toPrecision(d)));
}
function pct(value) { return value === null || value === undefined ? "–" : fmt(100 * value, 3) + "%"; }
function signed(value) { return value === null || value === undefined ? "–" : (value > 0 ? "+" : "") + fmt(value, 3); }
function visible(text) { return String(text).replace(/\n/g, "⏎").replace(/\t/g, "⇥"); }
function shown(name) { const text = visible(name); return text.trim() === "" ? text.replace(/ /g, "␣") : text; }
function stat(value, label) { return h("div", {class: "stat"}, h("b", {}, value), h("span", {}, label)); }
function card(title, ...children) { return h("section", {class: "card"}, title ? h("h2", {}, title) : null, ...children); }

function bars(values, colours, titles) {
  const n = Math.max(values.length, 1);
  const top = Math.max(...values.map(v => Math.abs(v || 0)), 1e-12);
  const chart = s("svg", {class: "chart", viewBox: `0 0 ${n} 100`, preserveAspectRatio: "none", role: "img"});
  values.forEach((v, i) => {
    const height = 100 * Math.abs(v || 0) / top;
    const bar = s("rect", {x: i + 0.1, y: 100 - height, width: 0.8, height: height, fill: colours[i]});
    if (titles) { const t = s("title"); t.textContent = titles[i]; bar.appendChild(t); }
    chart.appendChild(bar);
  });
  return chart;
}
function axis(left, right) { return h("div", {class: "axis"}, h("span", {}, left), h("span", {}, right)); }

function layer() { return D.layers[state.layer]; }
function unitValue(unit, key) {
  if (key === "load") return unit.load_fraction || 0;
  if (key === "selectivity") return unit.selectivity === null ? -1 : unit.selectivity;
  if (key === "ablation") return unit.ablation ? unit.ablation.delta_loss : -Infinity;
  if (key === "polysemanticity") return unit.ablation && unit.ablation.polysemanticity !== undefined ? -unit.ablation.polysemanticity : -Infinity;
  return -unit.id;
}
function matches(unit, query) {
  if (!query) return true;
  const q = query.toLowerCase();
  if (unit.label.toLowerCase().includes(q)) return true;
  if (q === "dead") return unit.dead;
  return unit.targets.some(([name]) => String(name).toLowerCase().includes(q));
}

function sidebar() {
  const L = layer();
  const search = h("input", {type: "search", placeholder: "search expert or token", value: state.query, "aria-label": "search",
    oninput: e => { state.query = e.target.value; renderList(); }});
  const options = [["load", "sort: usage"], ["selectivity", "sort: specialisation"], ["ablation", "sort: ablation Δloss"], ["id", "sort: index"]];
  if (D.kind === "classes" && L.units.some(u => u.ablation && u.ablation.polysemanticity !== undefined)) options.splice(2, 0, ["polysemanticity", "sort: monosemantic first"]);
  const sort = h("select", {"aria-label": "sort", onchange: e => { state.sort = e.target.value; renderList(); }},
    options.map(([value, text]) => h("option", {value: value, selected: value === state.sort ? "selected" : null}, text)));
  return h("aside", {}, card(null, h("div", {class: "controls"}, search, sort), h("ul", {class: "unit-list", id: "unit-list"})));
}
function renderList() {
  const L = layer();
  const list = document.getElementById("unit-list");
  list.replaceChildren();
  const units = L.units.filter(u => matches(u, state.query)).sort((a, b) => unitValue(b, state.sort) - unitValue(a, state.sort));
  const top = Math.max(...L.units.map(u => u.load_fraction || 0), 1e-12);
  for (const u of units) {
    const value = state.sort === "ablation" && u.ablation ? signed(u.ablation.delta_loss)
      : state.sort === "selectivity" ? fmt(u.selectivity)
      : state.sort === "polysemanticity" && u.ablation ? fmt(u.ablation.polysemanticity) : pct(u.load_fraction);
    list.appendChild(h("li", {class: (u.dead ? "dead " : "") + (u.id === state.unit ? "on" : ""), "data-unit": u.id,
        title: u.dead ? "never active" : "", onclick: () => go(state.layer, u.id)},
      h("span", {class: "name"}, u.label),
      h("span", {class: "meter"}, h("span", {style: `width:${100 * (u.load_fraction || 0) / top}%`})),
      h("span", {class: "value"}, value)));
  }
  if (!units.length) list.appendChild(h("li", {}, "no expert matches"));
}

function heatmap(values, mode) {
  const rows = values.length, cols = values[0].length;
  const top = Math.max(...values.flat(), 1e-12);
  const chart = s("svg", {class: "heat", viewBox: `0 0 ${cols} ${rows}`, role: "img"});
  values.forEach((row, i) => row.forEach((v, j) => {
    const cell = s("rect", {x: j, y: i, width: 1, height: 1, fill: `rgba(31,95,139,${(v / top).toFixed(3)})`, stroke: "#fff", "stroke-width": 0.04});
    const t = s("title"); t.textContent = `n${mode + 1}=${i}, n${mode + 2}=${j}: mean a·a = ${fmt(v)}`; cell.appendChild(t);
    chart.appendChild(cell);
  }));
  return chart;
}

function overview() {
  const L = layer();
  const parts = [];
  const dead = L.modes.reduce((n, m) => n + m.dead.length, 0);
  const dims = L.expert_dims.join("×");
  const stats = [stat(dims, "experts per mode"), stat(L.rows.toLocaleString(), "rows (tokens) seen"),
    stat(L.modes.map(m => fmt(m.active_per_row)).join(" · "), "active experts per row"),
    stat(L.modes.map(m => pct(m.active_per_row / m.experts)).join(" · "), "coefficient density"),
    stat(String(dead), "dead experts")];
  if (L.loss !== null) stats.push(stat(fmt(L.loss, 4), `loss on ${D.ablation_samples} samples`));
  if (L.polysemanticity !== null) stats.push(stat(fmt(L.polysemanticity), "mean polysemanticity"));
  parts.push(card(`${L.name} — ${L.type}`, h("p", {class: "muted"}, L.description), h("div", {class: "stats"}, stats)));
  const warnings = L.modes.map((m, e) => m.dead.length ? h("div", {class: "warn"},
    `${m.dead.length} of ${m.experts} experts of mode ${e} were never active on ${L.rows.toLocaleString()} rows: `,
    m.dead.slice(0, 40).join(", ") + (m.dead.length > 40 ? ", …" : "")) : null).filter(Boolean);
  const usage = L.modes.map((m, e) => h("div", {},
    h("h3", {}, L.modes.length > 1 ? `Load of mode ${e} (n${e + 1})` : "Load per expert"),
    bars(m.load, m.load.map((v, i) => m.dead.includes(i) ? "#c0392b" : "#2e86c1"), m.load.map((v, i) => `expert ${i}: ${pct(v)} of rows`)),
    axis("expert 0", `expert ${m.experts - 1}`),
    h("div", {class: "legend"}, h("span", {}, h("i", {style: "background:#2e86c1"}), "fraction of rows using it"),
      h("span", {}, h("i", {style: "background:#c0392b"}), "dead"))));
  parts.push(card("Expert usage", ...warnings, h("div", {class: "grid2"}, usage)));
  const units = L.units;
  const specialised = units.filter(u => u.selectivity !== null).sort((a, b) => b.selectivity - a.selectivity);
  const charts = [h("div", {}, h("h3", {}, "Specialisation (1 = a single " + (D.kind === "text" ? "token" : "class") + ")"),
    bars(units.map(u => u.selectivity || 0), units.map(() => "#7d5ba6"), units.map(u => `${u.label}: ${fmt(u.selectivity)}`)),
    axis(units[0].label, units[units.length - 1].label))];
  if (units[0].ablation) charts.push(h("div", {}, h("h3", {}, "Loss change when ablated"),
    bars(units.map(u => u.ablation.delta_loss), units.map(u => u.ablation.delta_loss > 0 ? "#c0392b" : "#2e86c1"),
      units.map(u => `${u.label}: Δloss ${signed(u.ablation.delta_loss)}`)),
    axis(units[0].label, units[units.length - 1].label)));
  parts.push(card("Specialisation and ablation", h("div", {class: "grid2"}, charts),
    h("h3", {}, "Most specialised"),
    h("div", {class: "chips"}, specialised.slice(0, 12).map(u => h("span", {class: "chip", style: "cursor:pointer", onclick: () => go(state.layer, u.id)},
      `${u.label}: `, h("code", {}, u.targets.length ? shown(u.targets[0][0]) : "–"), ` ${fmt(u.selectivity)}`)))));
  if (L.joint.length) parts.push(card("Hierarchical view: joint load of neighbouring modes",
    h("p", {class: "muted"}, "Mean of a(n_e)·a(n_e+1) over rows; rows are n_e, columns n_e+1. Each slice has its own page (units “(k, ·)”)."),
    h("div", {class: "grid2"}, L.joint.map((values, e) => h("div", {}, h("h3", {}, `modes ${e} × ${e + 1}`), heatmap(values, e))))));
  return parts;
}

function histogram(u) {
  const counts = u.histogram, n = counts.length;
  return h("div", {}, h("h3", {}, "Coefficient histogram (active rows)"),
    bars(counts, counts.map(() => "#2e86c1"), counts.map((c, i) => `${fmt(i / n)}–${fmt((i + 1) / n)}: ${c} rows`)),
    axis("0", layer().modes[u.mode].largest > 1 ? "≥ 1 (larger in the last bin)" : "1"));
}
function tokenExample(ex) {
  const peak = Math.max(...ex.tokens.map(t => t[1] || 0), 1e-12);
  const text = h("div", {class: "text"}, ex.tokens.map(([token, c], i) => h("span", {class: "tok" + (i === ex.centre ? " centre" : ""),
    title: `coefficient ${fmt(c)}`, style: `background:rgba(46,134,193,${((c || 0) / peak * 0.75).toFixed(3)})`}, visible(token))));
  return h("div", {class: "example"}, h("span", {class: "where"}, `seq ${ex.sample} · pos ${ex.position}`), text, h("span", {class: "coef"}, fmt(ex.value)));
}
function imageExample(ex) {
  const shape = D.image_shape, pixels = D.images[String(ex.sample)];
  const canvas = h("canvas", {width: shape[1], height: shape[0]});
  const context = canvas.getContext("2d");
  const image = context.createImageData(shape[1], shape[0]);
  for (let k = 0; k < shape[0] * shape[1]; k++) {
    const rgb = shape.length === 3 ? [pixels[3 * k], pixels[3 * k + 1], pixels[3 * k + 2]] : [pixels[k], pixels[k], pixels[k]];
    image.data.set([...rgb, 255], 4 * k);
  }
  context.putImageData(image, 0, 0);
  return h("figure", {}, canvas, h("figcaption", {}, `class ${ex.label} · ${fmt(ex.value)}`), h("div", {class: "muted"}, `#${ex.sample} row ${ex.position}`));
}
function chips(items, negative, format) {
  return h("div", {class: "chips"}, items.map(([name, value]) => h("span", {class: "chip" + (negative ? " neg" : "")}, h("code", {}, shown(name)), " " + format(value))));
}

function unitPage() {
  const L = layer(), u = L.units[state.unit];
  const kindName = L.expert_dims.length > 1 ? `slice ${u.label} (n${u.mode + 1} = ${u.index}, every other index)` : `expert ${u.label}`;
  const parts = [];
  const stats = [stat(pct(u.load_fraction), `load (${u.load.toLocaleString()} rows)`), stat(fmt(u.mean), "mean coefficient"),
    stat(fmt(u.max), "largest coefficient"), stat(fmt(u.selectivity), "specialisation")];
  if (u.ablation) stats.push(stat(signed(u.ablation.delta_loss), "Δloss when ablated"));
  if (u.ablation && u.ablation.polysemanticity !== undefined) stats.push(stat(fmt(u.ablation.polysemanticity), "polysemanticity"));
  parts.push(card(`${L.name}: ${kindName}`, h("p", {class: "muted"}, h("a", {class: "back", onclick: () => go(state.layer, null)}, "← layer overview")),
    u.dead ? h("div", {class: "warn"}, `This ${L.expert_dims.length > 1 ? "slice" : "expert"} was never active on the data.`) : null,
    h("div", {class: "stats"}, stats)));
  let examples;
  if (!u.examples.length) examples = h("p", {class: "muted"}, "No active row.");
  else if (D.kind === "text") examples = h("div", {class: "examples"}, u.examples.map(tokenExample));
  else if (D.image_shape) examples = h("div", {class: "images"}, u.examples.map(imageExample));
  else examples = h("table", {}, h("tr", {}, h("th", {}, "sample"), h("th", {}, "row"), h("th", {}, "class"), h("th", {class: "num"}, "coefficient")),
    u.examples.map(ex => h("tr", {}, h("td", {}, ex.sample), h("td", {}, ex.position), h("td", {}, ex.label), h("td", {class: "num"}, fmt(ex.value)))));
  parts.push(card(`Top ${u.examples.length} activating ${D.kind === "text" ? "tokens in context" : "examples"}`, examples));
  const targetTitle = D.kind === "text" ? "Tokens carrying its coefficient mass" : "Class breakdown of its coefficient mass";
  parts.push(card(null, h("div", {class: "grid2"}, histogram(u),
    h("div", {}, h("h3", {}, targetTitle), u.targets.length ? chips(u.targets, false, pct) : h("p", {class: "muted"}, "–")))));
  if (u.ablation) {
    const a = u.ablation;
    const effect = [h("p", {}, `Switching it off changes the mean loss by ${signed(a.delta_loss)} on ${D.ablation_samples} samples.`)];
    if (D.kind === "classes" && a.classes) effect.push(h("table", {},
      h("tr", {}, h("th", {}, "class"), h("th", {class: "num"}, "accuracy"), h("th", {class: "num"}, "ablated"), h("th", {class: "num"}, "Δloss")),
      a.classes.map(c => h("tr", {}, h("td", {}, c.class), h("td", {class: "num"}, pct(c.accuracy)), h("td", {class: "num"}, pct(c.ablated)), h("td", {class: "num"}, signed(c.delta_loss))))));
    else effect.push(h("h3", {}, "Next tokens whose loss rises most"), a.hurt.length ? h("table", {},
      h("tr", {}, h("th", {}, "target"), h("th", {class: "num"}, "Δloss"), h("th", {class: "num"}, "count")),
      a.hurt.map(([name, d, c]) => h("tr", {}, h("td", {}, h("code", {}, shown(name))), h("td", {class: "num"}, signed(d)), h("td", {class: "num"}, c)))) : h("p", {class: "muted"}, "–"));
    effect.push(h("div", {class: "grid2"},
      h("div", {}, h("h3", {}, "It promotes (log p falls when ablated)"), chips(a.promoted, false, signed)),
      h("div", {}, h("h3", {}, "It suppresses (log p rises when ablated)"), chips(a.suppressed, true, signed))));
    parts.push(card("Effect of ablating it", ...effect));
  }
  return parts;
}

function go(layerIndex, unit) {
  location.hash = unit === null ? `layer=${layerIndex}` : `layer=${layerIndex}&unit=${unit}`;
}
function route() {
  const params = new URLSearchParams(location.hash.slice(1));
  const l = Number(params.get("layer") || 0), u = params.get("unit");
  state.layer = Number.isInteger(l) && l >= 0 && l < D.layers.length ? l : 0;
  const units = D.layers[state.layer].units.length;
  state.unit = u !== null && Number.isInteger(Number(u)) && Number(u) >= 0 && Number(u) < units ? Number(u) : null;
  render();
}
function render() {
  const root = document.getElementById("app");
  const total = D.layers.reduce((n, L) => n + L.units.length, 0);
  const header = h("header", {}, h("h1", {}, D.title),
    h("p", {}, `${D.layers.length} μMoE layer${D.layers.length > 1 ? "s" : ""} · ${total} experts and slices · ${D.samples.toLocaleString()} ` +
      `${D.kind === "text" ? "sequences" : "samples"} · top ${D.top_k} examples per expert`));
  const nav = h("nav", {class: "layers"}, D.layers.map((L, i) => h("button", {class: i === state.layer ? "on" : "", onclick: () => go(i, null)}, L.name)));
  const main = h("main", {id: "content"}, state.unit === null ? overview() : unitPage());
  root.replaceChildren(header, nav, h("div", {class: "layout"}, sidebar(), main));
  renderList();
  document.title = state.unit === null ? `${D.title} — ${layer().name}` : `${D.title} — ${layer().name} ${layer().units[state.unit].label}`;
  document.body.setAttribute("data-ready", "true");
}
window.addEventListener("hashchange", route);
route();
"""

CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"


def render(data: dict) -> str:
    """The page for the explorer's ``data`` (as built by [`explore`][mumoe_tn.analysis.explorer.explore])."""
    payload = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    title = html.escape(str(data.get("title", "Experts")))
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        f"<title>{title}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n<div id=\"app\"></div>\n"
        f"<script type=\"application/json\" id=\"explorer-data\">{payload}</script>\n"
        f"<script>{SCRIPT}</script>\n</body>\n</html>\n"
    )
