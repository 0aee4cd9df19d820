// Boots a static kvscope page: the same view modules as in Jupyter, each driven by a small
// in-page model instead of a kernel. All steps' states are in one deflated JSON payload; the
// pool goes as block deltas from one exported step to the next (the first one a keyframe).

class StaticModel {
  constructor(hub, state) { this.hub = hub; this.state = state; this.handlers = {}; }
  get(name) { return this.state[name]; }
  set(name, value) {
    this.state[name] = value;
    for (const fn of this.handlers[`change:${name}`] || []) fn();
    if (this.hub.shared.includes(name)) this.hub.share(this, name, value);
  }
  on(events, fn) { for (const e of events.split(" ")) (this.handlers[e] ||= []).push(fn); }
  off(events, fn) { for (const e of events.split(" ")) this.handlers[e] = (this.handlers[e] || []).filter((f) => f !== fn); }
  save_changes() {}
  send(msg) { if (this.onsend) this.onsend(msg); } // no kernel: hover facts come with the page
}

class Hub {
  constructor() { this.models = []; this.shared = ["selected_request", "selected_block"]; }
  share(from, name, value) {
    for (const m of this.models) if (m !== from && name in m.state && m.state[name] !== value) {
      m.state[name] = value;
      for (const fn of m.handlers[`change:${name}`] || []) fn();
    }
  }
  update(model, state) {
    const changed = Object.keys(state).filter((k) => model.state[k] !== state[k]);
    Object.assign(model.state, state);
    for (const k of changed) for (const fn of model.handlers[`change:${k}`] || []) fn();
  }
}

function b64bytes(s) {
  const bin = atob(s);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

async function inflateText(b64) {
  const stream = new Blob([b64bytes(b64)]).stream().pipeThrough(new DecompressionStream("deflate"));
  return new Response(stream).text();
}

async function main() {
  const byId = (id) => document.getElementById(id);
  const meta = JSON.parse(byId("kvscope-meta").textContent);
  const modules = JSON.parse(byId("kvscope-modules").textContent);
  const data = JSON.parse(await inflateText(byId("kvscope-data").textContent.trim()));
  for (const [name, s] of Object.entries(data.fixed)) for (const key of data.binary[name] || []) s[key] = b64bytes(s[key]).buffer;
  const plotly = byId("kvscope-plotly");
  if (plotly) document.head.append(h("script", {}, await inflateText(plotly.textContent.trim())));
  const hub = new Hub();
  const models = {};
  let shown = 0; // the exported step the views show
  for (const [name, src] of Object.entries(modules)) {
    const url = URL.createObjectURL(new Blob([src], { type: "text/javascript" }));
    const mod = (await import(url)).default;
    const model = new StaticModel(hub, { selected_request: meta.selected_request, selected_block: -1 });
    model.widget_manager = { get_model: async (id) => models[id] }; // a linked view reads another's model by name
    hub.models.push(model);
    models[name] = model;
    if (name === "pool") model.onsend = (msg) => { if (msg.type === "resync") hub.update(model, poolKeyframe(data, shown)); };
    hub.update(model, stateOf(name, data, 0, -1));
    mod.render({ model, el: byId(`kvscope-${name}`) });
  }
  const slider = byId("kvscope-slider"), label = byId("kvscope-step");
  slider.max = data.steps.length - 1;
  slider.value = Math.max(0, data.steps.indexOf(meta.step));
  function show() {
    const i = Number(slider.value);
    for (const [name, model] of Object.entries(models)) hub.update(model, stateOf(name, data, i, shown));
    shown = i;
    label.textContent = `step ${data.steps[i]} (${i + 1} of ${data.steps.length} exported)`;
    const plot = byId("kvscope-timeline");
    if (window.Plotly && plot.data) Plotly.relayout(plot, { "shapes[0].x0": data.steps[i], "shapes[0].x1": data.steps[i], "shapes[0].visible": true });
    document.body.dataset.step = data.steps[i];
  }
  slider.addEventListener("input", show);
  if (window.Plotly) {
    const fig = JSON.parse(byId("kvscope-figure").textContent);
    await Plotly.newPlot(byId("kvscope-timeline"), fig.data, fig.layout, { responsive: true });
  }
  show();
  document.body.dataset.ready = "1";
}

/** One view's state at exported step `i`, coming from step `prev`; binary arrays arrive base64-encoded. */
function stateOf(name, data, i, prev) {
  if (name === "pool" && i !== prev + 1) return poolKeyframe(data, i);
  const s = decoded(name, data, i);
  if (name === "pool") s.details = detailsAt(data, i);
  return s;
}

/** View `name`'s exported state at step `i`, its binary traits decoded. */
function decoded(name, data, i) {
  const s = { ...(data.fixed[name] || {}), ...data.views[name][i] };
  for (const key of data.binary[name] || []) if (typeof s[key] === "string") s[key] = b64bytes(s[key]).buffer;
  return s;
}

/** The pool at exported step `i` as a keyframe: the deltas of steps 0..i folded together. */
function poolKeyframe(data, i) {
  const blocks = new Map();
  for (let j = 0; j <= i; j++) {
    const d = kvsDecodeDelta(b64bytes(data.views.pool[j].delta).buffer);
    for (let k = 0; k < d.ids.length; k++) blocks.set(d.ids[k], [d.states[k], d.refs[k]]);
  }
  return { ...decoded("pool", data, i), delta: kvsEncodeDelta(blocks), delta_base: -1, details: detailsAt(data, i) };
}

/** Hover facts at exported step `i`: each step lists the blocks whose facts it changed. */
function detailsAt(data, i) {
  let at = data.detailsAt; // the last one folded: {i, facts}
  if (!at || at.i > i) at = { i: -1, facts: {} };
  for (let j = at.i + 1; j <= i; j++) at = { i: j, facts: { ...at.facts, ...data.details[j] } };
  data.detailsAt = at;
  return at.facts;
}

main().catch((e) => { document.body.dataset.error = String(e); console.error(e); });
