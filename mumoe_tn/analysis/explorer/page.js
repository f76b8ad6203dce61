// The expert explorer's page: renders the inline JSON findings; every text from the data goes in as a text node.
"use strict";
const D = JSON.parse(document.getElementById("explorer-data").textContent);
const state = {layer: 0, unit: null, sort: "load", query: ""};
const SVG = "http://www.w3.org/2000/svg";
const DEAD = "#c0392b";

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
    const height = Math.max(100 * Math.abs(v || 0) / top, colours[i] === DEAD ? 4 : 0);  // a dead expert still shows
    const bar = s("rect", {x: i + 0.1, y: 100 - height, width: 0.8, height: height, fill: colours[i]});
    if (titles) { const t = s("title"); t.textContent = titles[i]; bar.appendChild(t); }
    chart.appendChild(bar);
  });
  return chart;
}
function axis(left, right, middle) {
  return h("div", {class: "axis"}, h("span", {}, left), middle ? h("span", {}, middle) : null, h("span", {}, right));
}
function peak(values) { return "max " + fmt(Math.max(...values.map(v => Math.abs(v || 0)))); }

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
    const t = s("title");
    t.textContent = `n${mode + 1}=${i}, n${mode + 2}=${j}: mean a·a = ${fmt(v)} (click: the slice n${mode + 1}=${i})`;
    cell.appendChild(t);
    const first = layer().expert_dims.slice(0, mode).reduce((n, size) => n + size, 0);
    cell.addEventListener("click", () => go(state.layer, first + i));
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
    bars(m.load, m.load.map((v, i) => m.dead.includes(i) ? DEAD : "#2e86c1"), m.load.map((v, i) => `expert ${i}: ${pct(v)} of rows`)),
    axis(L.modes.length > 1 ? `n${e + 1} = 0` : "expert 0", L.modes.length > 1 ? `n${e + 1} = ${m.experts - 1}` : `expert ${m.experts - 1}`, peak(m.load)),
    h("div", {class: "legend"}, h("span", {}, h("i", {style: "background:#2e86c1"}), "fraction of rows using it"),
      h("span", {}, h("i", {style: "background:#c0392b"}), "dead"))));
  parts.push(card("Expert usage", ...warnings, h("div", {class: "grid2"}, usage)));
  const units = L.units;
  const used = units.filter(u => u.selectivity !== null && u.load_fraction >= 0.01);  // rare ones say little
  const specialised = (used.length ? used : units.filter(u => u.selectivity !== null)).sort((a, b) => b.selectivity - a.selectivity);
  const charts = [h("div", {}, h("h3", {}, "Specialisation (1 = a single " + (D.kind === "text" ? "token" : "class") + ")"),
    bars(units.map(u => u.selectivity || 0), units.map(() => "#7d5ba6"), units.map(u => `${u.label}: ${fmt(u.selectivity)}`)),
    axis(units[0].label, units[units.length - 1].label, peak(units.map(u => u.selectivity))))];
  if (units[0].ablation) charts.push(h("div", {}, h("h3", {}, "Loss change when ablated"),
    bars(units.map(u => u.ablation.delta_loss), units.map(u => u.ablation.delta_loss > 0 ? "#e67e22" : "#2e86c1"),
      units.map(u => `${u.label}: Δloss ${signed(u.ablation.delta_loss)}`)),
    axis(units[0].label, units[units.length - 1].label, "largest |Δ| " + fmt(Math.max(...units.map(u => Math.abs(u.ablation.delta_loss || 0)))))));
  parts.push(card("Specialisation and ablation", h("div", {class: "grid2"}, charts),
    h("h3", {}, "Most specialised (of those loading ≥ 1% of rows)"),
    h("div", {class: "chips"}, specialised.slice(0, 12).map(u => h("span", {class: "chip", style: "cursor:pointer", onclick: () => go(state.layer, u.id)},
      `${u.label}: `, h("code", {}, u.targets.length ? shown(u.targets[0][0]) : "–"), ` ${fmt(u.selectivity)}`)))));
  if (L.joint.length) parts.push(card("Hierarchical view: joint load of neighbouring modes",
    h("p", {class: "muted"}, "Mean of a(n_e)·a(n_e+1) over rows; rows are n_e, columns n_e+1. Each slice has its own page (units “(k, ·)”)."),
    h("div", {class: "grid2"}, L.joint.map((values, e) => h("div", {}, h("h3", {}, `modes ${e} × ${e + 1}`), heatmap(values, e))))));
  return parts;
}

function histogram(u) {
  const counts = u.histogram, n = counts.length, top = layer().modes[u.mode].upper || 1;
  return h("div", {}, h("h3", {}, "Coefficient histogram (active rows)"),
    bars(counts, counts.map(() => "#2e86c1"), counts.map((c, i) => `${fmt(i * top / n)}–${fmt((i + 1) * top / n)}: ${c} rows`)),
    axis("0", fmt(top), `tallest ${Math.max(...counts)} rows`));
}
function tokenExample(ex) {
  const peak = Math.max(...ex.tokens.map(t => t[1] || 0), 1e-12);
  const text = h("div", {class: "text"}, ex.tokens.map(([token, c], i) => h("span", {class: "tok" + (i === ex.centre ? " centre" : ""),
    title: `coefficient ${fmt(c)}`, style: `background:rgba(46,134,193,${((c || 0) / peak * 0.45).toFixed(3)})`}, visible(token))));
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
  return h("figure", {}, canvas, h("figcaption", {}, `class ${ex.label} · ${fmt(ex.value)}`), h("div", {class: "muted"}, `#${ex.sample} row${ex.rows.length > 1 ? "s" : ""} ${ex.rows.join(", ")}`));
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
  let examples, what = D.kind === "text" ? "tokens in context" : "examples";
  if (!u.examples.length) examples = h("p", {class: "muted"}, "No active row.");
  else if (D.kind === "text") examples = h("div", {class: "examples"}, u.examples.map(tokenExample));
  else if (D.image_shape) {  // one image per sample, with every top row it holds
    const samples = new Map();
    for (const ex of u.examples) {
      if (!samples.has(ex.sample)) samples.set(ex.sample, {...ex, rows: []});
      samples.get(ex.sample).rows.push(ex.position);
    }
    examples = h("div", {class: "images"}, [...samples.values()].map(imageExample));
    what = `rows, in ${samples.size} image${samples.size > 1 ? "s" : ""}`;
  }
  else examples = h("table", {}, h("tr", {}, h("th", {}, "sample"), h("th", {}, "row"), h("th", {}, "class"), h("th", {class: "num"}, "coefficient")),
    u.examples.map(ex => h("tr", {}, h("td", {}, ex.sample), h("td", {}, ex.position), h("td", {}, ex.label), h("td", {class: "num"}, fmt(ex.value)))));
  parts.push(card(`Top ${u.examples.length} activating ${what}`, examples));
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
  const params = new URLSearchParams({layer: D.layers[layerIndex].name});  // the layer's module path
  if (unit !== null) params.set("unit", unit);
  location.hash = params.toString();
}
function route() {
  const params = new URLSearchParams(location.hash.slice(1));
  const name = params.get("layer"), u = params.get("unit");
  const named = D.layers.findIndex(L => L.name === name);
  const l = named >= 0 ? named : Number(name || 0);  // a module path, or a layer's position
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
