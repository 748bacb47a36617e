"use strict";
// The valve panel: POST /v1/sluice/valves with the context, drawn as small inline SVG charts.
// One request in flight at a time; while it runs, only the newest context waits (older ones are
// dropped). The server measures on its engine's thread, between two generation steps, so while the
// model writes the panel waits GAP_FACTOR times the last measurement's duration between two: the
// valves then take at most a fifth of the engine's time. The last context of an answer ("final") is
// measured without waiting.

const Valves = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const W = 420, H = 150, PAD = { l: 38, r: 8, t: 8, b: 22 };
  const KIND_COLOURS = { attn: "#4f7cac", mlp: "#c07a2f", q: "#7a9f5a", k: "#9b6fb0", final: "#a3261b", other: "#888" };
  const GAP_FACTOR = 4, MIN_GAP_MS = 250;
  let inflight = false, pending = null, generation = 0, lastMs = 0, lastEnd = 0;

  const $ = (sel) => document.querySelector(sel);
  function el(tag, attrs, parent, text) {
    const node = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }
  function svgOf(valve) {
    const svg = $(`figure[data-valve="${valve}"] svg`);
    svg.replaceChildren();
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    return svg;
  }
  const fmt = (v) => (typeof v === "number" ? (Math.abs(v) >= 100 ? v.toFixed(0) : v.toPrecision(3)) : String(v));

  // A y axis, linear or log10, over [lo, hi]; returns the value -> pixel function.
  function yAxis(svg, lo, hi, log) {
    const f = log ? Math.log10 : (x) => x;
    const a = f(lo), b = f(hi), span = b - a || 1;
    const y = (v) => PAD.t + (1 - (f(Math.max(v, log ? lo : -Infinity)) - a) / span) * (H - PAD.t - PAD.b);
    el("line", { x1: PAD.l, x2: PAD.l, y1: PAD.t, y2: H - PAD.b, class: "axis" }, svg);
    const ticks = log ? Array.from({ length: Math.floor(b) - Math.ceil(a) + 1 }, (_, i) => 10 ** (Math.ceil(a) + i))
                      : niceTicks(lo, hi);
    for (const t of ticks) {
      el("line", { x1: PAD.l - 3, x2: W - PAD.r, y1: y(t), y2: y(t), class: "axis", "stroke-opacity": 0.5 }, svg);
      el("text", { x: PAD.l - 5, y: y(t) + 3, "text-anchor": "end" }, svg, fmt(t));
    }
    return y;
  }
  // Round steps (1, 2 or 5 times a power of ten), about four of them over [lo, hi].
  function niceTicks(lo, hi) {
    const raw = (hi - lo) / 4 || 1, p = 10 ** Math.floor(Math.log10(raw));
    const step = [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw);
    const out = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + 1e-9; t += step) out.push(Math.abs(t) < 1e-9 ? 0 : t);
    return out;
  }
  const finite = (xs) => xs.filter((v) => typeof v === "number" && isFinite(v));

  // Bars (one per label), optionally a dot per label; every bar carries its exact value in data-value.
  function bars(svg, labels, values, { log, base, colours, dots, names }) {
    const all = finite([...values, ...(dots || []), ...(base ? [base] : [])]);
    let lo = Math.min(...all), hi = Math.max(...all);
    if (log) { lo = 10 ** Math.floor(Math.log10(lo)); hi = 10 ** Math.ceil(Math.log10(hi)); }
    const y = yAxis(svg, lo, hi, log);
    const step = (W - PAD.l - PAD.r) / labels.length, w = Math.max(2, step * 0.7);
    const from = y(base !== undefined ? base : lo);
    labels.forEach((label, i) => {
      const x = PAD.l + i * step + (step - w) / 2, v = values[i];
      if (typeof v !== "number" || !isFinite(v)) return;
      const rect = el("rect", { x, width: w, y: Math.min(from, y(v)), height: Math.max(1, Math.abs(from - y(v))),
                               fill: colours ? colours[i] : "#4f7cac", "data-value": String(v), "data-index": i,
                               "data-name": names ? names[i] : label }, svg);
      el("title", {}, rect, `${names ? names[i] : label}: ${fmt(v)}` + (dots ? `, last token ${fmt(dots[i])}` : ""));
      if (dots && isFinite(dots[i])) el("circle", { cx: x + w / 2, cy: y(dots[i]), r: 2.4, fill: "#1d1d1f", "data-last": String(dots[i]) }, svg);
      if (label && (labels.length <= 16 || labels.filter(Boolean).length <= 16 || i % Math.ceil(labels.length / 16) === 0))
        el("text", { x: x + w / 2, y: H - PAD.b + 12, "text-anchor": "middle" }, svg, label);
    });
    return y;
  }

  function residual(data) {
    const r = data.residual, labels = r.rms_mean.map((_, i) => `x${i}`);
    bars(svgOf("residual"), labels, r.rms_mean, { log: true, dots: r.rms_last });
  }

  function normKind(name) {
    const last = name.split(".").pop();
    if (name === "final_norm") return "final";
    if (last.startsWith("q_")) return "q";
    if (last.startsWith("k_")) return "k";
    return last.startsWith("attn") ? "attn" : last.startsWith("mlp") ? "mlp" : "other";
  }
  function gains(data) {
    const n = data.norms, kinds = n.names.map(normKind);
    // the layer's number under its first norm only, "final" under the final norm
    const layerOf = (name) => (name.match(/^layers\.(\d+)\./) || [, ""])[1];
    const labels = n.names.map((name, i) => (kinds[i] === "final" ? "final"
      : i > 0 && layerOf(n.names[i - 1]) === layerOf(name) ? "" : `L${layerOf(name)}`));
    const svg = svgOf("gains");
    const y = bars(svg, labels, n.gain_mean, { log: true, base: 1, dots: n.gain_last, names: n.names,
                                                colours: kinds.map((k) => KIND_COLOURS[k]) });
    el("line", { x1: PAD.l, x2: W - PAD.r, y1: y(1), y2: y(1), class: "one" }, svg);
    let x = PAD.l + 6;
    for (const k of [...new Set(kinds)]) {
      el("rect", { x, y: PAD.t, width: 8, height: 8, fill: KIND_COLOURS[k] }, svg);
      el("text", { x: x + 11, y: PAD.t + 8 }, svg, k);
      x += 16 + 6 * k.length;
    }
  }

  function logits(data) {
    const L = data.logits, T = L.max.length, svg = svgOf("logits");
    const fp16 = data.softmax.with_final_norm.headroom.float16 + data.softmax.with_final_norm.logit_max;
    const all = finite([...L.max, ...L.min, ...L.logsumexp, fp16]);
    const lo = Math.min(...all), hi = Math.max(...all);
    const y = yAxis(svg, lo, hi + 0.15 * (hi - lo), false);  // the top strip stays free for the key
    const x = (t) => PAD.l + (T === 1 ? 0.5 : t / (T - 1)) * (W - PAD.l - PAD.r);
    const band = [...L.max.map((v, t) => `${x(t)},${y(v)}`), ...L.min.map((v, t) => `${x(t)},${y(v)}`).reverse()];
    el("polygon", { points: band.join(" "), fill: "#4f7cac", "fill-opacity": 0.25, stroke: "#4f7cac", "stroke-width": 0.8 }, svg);
    el("polyline", { points: L.logsumexp.map((v, t) => `${x(t)},${y(v)}`).join(" "), fill: "none", stroke: "#1d1d1f", "stroke-width": 1.2 }, svg);
    el("line", { x1: PAD.l, x2: W - PAD.r, y1: y(fp16), y2: y(fp16), class: "ref" }, svg);
    el("line", { x1: W - PAD.r - 146, x2: W - PAD.r - 126, y1: PAD.t + 5, y2: PAD.t + 5, class: "ref" }, svg);
    el("text", { x: W - PAD.r, y: PAD.t + 8, "text-anchor": "end" }, svg, `fp16 exp() limit ${fmt(fp16)}`);
    const t = T - 1;
    el("text", { x: PAD.l + 4, y: H - 4 }, svg,
       `${T} positions · last: max ${fmt(L.max[t])}, min ${fmt(L.min[t])}, entropy ${fmt(L.entropy[t])} nats, top-1 p ${fmt(L.top1_prob[t])}`);
  }

  function softmax(data) {
    const table = $('figure[data-valve="softmax"] table');
    table.replaceChildren();
    const row = (cells, tag = "td") => {
      const tr = document.createElement("tr");
      for (const c of cells) {
        const td = document.createElement(tag);
        if (typeof c === "object") { td.textContent = c.text; td.className = c.cls || ""; td.title = c.title || ""; } else td.textContent = c;
        tr.appendChild(td);
      }
      table.appendChild(tr);
    };
    row(["dtype", "exp() limit", "headroom", "without final norm", "naive", "safe", "online"], "th");
    const w = data.softmax.with_final_norm, wo = data.softmax.without_final_norm;
    for (const dtype of Object.keys(w.headroom)) {
      const limit = w.headroom[dtype] + w.logit_max;
      const head = (h) => ({ text: fmt(h), cls: h < 0 ? "bad" : "ok" });
      const method = (m) => {
        const r = w.table.find((e) => e.method === m && e.dtype === dtype);
        return r.rows_broken ? { text: "broken", cls: "bad", title: `${r.overflow} exp() overflowed; denominator overflowed: ${r.denom_overflow ? "yes" : "no"}` }
                             : { text: "ok", cls: "ok", title: `max |p − p_fp64| ${fmt(r.max_abs_err)}` };
      };
      row([dtype, fmt(limit), head(w.headroom[dtype]), head(wo.headroom[dtype]), method("naive"), method("safe"), method("online")]);
    }
  }

  function draw(data) {
    $("#ctx").textContent = `(${data.tokens} tokens, ${data.num_layers} layers)`;
    const status = $("#valves-status");
    status.className = "muted";
    status.textContent = data.nonfinite ? `non-finite values first appear in ${data.nonfinite.module}` : "";
    status.hidden = !data.nonfinite;
    residual(data); gains(data); logits(data); softmax(data);
    document.body.dataset.valvesTokens = data.tokens;  // for tests and scripts: what the panel shows
  }

  function showError(message) {
    const status = $("#valves-status");
    status.hidden = false;
    status.className = "error";
    status.textContent = message;
  }

  async function pump() {
    inflight = true;
    while (pending) {
      const wait = lastEnd + Math.max(MIN_GAP_MS, GAP_FACTOR * lastMs) - performance.now();
      if (!pending.final && wait > 0) {
        await new Promise((resolve) => setTimeout(resolve, wait));
        continue;  // pending may have changed meanwhile (a newer context, a final one, a reset)
      }
      const { body, headers } = pending, gen = generation;
      pending = null;
      const start = performance.now();
      try {
        const r = await fetch("/v1/sluice/valves", { method: "POST", headers, body: JSON.stringify(body) });
        const data = await r.json();
        lastEnd = performance.now();
        lastMs = lastEnd - start;
        if (gen !== generation) continue;
        if (r.ok) draw(data); else showError(`valves: ${data.error ? data.error.message : r.status}`);
      } catch (e) {
        if (gen === generation) showError(`valves: ${e}`);
      }
    }
    inflight = false;
  }

  return {
    // The context grew: measure it (after the gap, or when the request in flight is back; final: no gap).
    grow(body, headers, final = false) { pending = { body, headers, final }; if (!inflight) pump(); },
    reset() {
      generation++; pending = null;
      document.querySelectorAll("figure[data-valve] svg, figure[data-valve] table").forEach((n) => n.replaceChildren());
      $("#ctx").textContent = "";
      delete document.body.dataset.valvesTokens;
    },
  };
})();
