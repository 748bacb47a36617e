"use strict";
// The conversation: streams from this server's own /v1/completions or /v1/chat/completions with
// logprobs, one span per generated token, coloured by its probability, underlined by the entropy of
// the whole distribution (sluice's "entropy" extension), its alternatives on hover. Model text only
// ever reaches the page through textContent.

const $ = (id) => document.getElementById(id);
const STOPS = [[0, [0xf4, 0xa6, 0xa0]], [0.25, [0xf7, 0xc5, 0x8f]], [0.5, [0xf3, 0xe1, 0x9a]],
               [0.75, [0xcf, 0xe6, 0xb0]], [1, [0xe6, 0xf2, 0xdf]]];  // live.css --p0 .. --p100
const state = { doc: "", messages: [], controller: null, tokens: [] };

function colour(p) {
  for (let i = 1; i < STOPS.length; i++) {
    const [p1, c1] = STOPS[i], [p0, c0] = STOPS[i - 1];
    if (p <= p1) {
      const f = (p - p0) / (p1 - p0);
      return `rgb(${c0.map((c, j) => Math.round(c + f * (c1[j] - c))).join(",")})`;
    }
  }
  return `rgb(${STOPS[STOPS.length - 1][1].join(",")})`;
}
const visible = (s) => s.replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/ /g, "·") || "∅";
const pct = (lp) => `${(100 * Math.exp(lp)).toPrecision(3)}%`;

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}
function status(text, error = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "muted";
}
async function failure(r) {
  let message = `HTTP ${r.status}`;
  try { message = (await r.json()).error.message; } catch (e) { /* not JSON */ }
  return r.status === 401 ? `${message} (enter the key under "API key" above)` : message;
}

// Server-sent events of a fetch response, parsed: one object per "data:" line until [DONE].
async function* events(response) {
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        if (line === "data: [DONE]") return;
        yield JSON.parse(line.slice(6));
      }
    }
  }
}

// Both logprobs shapes -> [{token, logprob, entropy, top: [{token, logprob}]}]
function tokensOf(choice) {
  const lp = choice.logprobs;
  if (!lp) return [];
  if (lp.content) return lp.content.map((t) => ({ token: t.token, logprob: t.logprob, entropy: t.entropy, top: t.top_logprobs }));
  return lp.tokens.map((token, i) => ({
    token, logprob: lp.token_logprobs[i], entropy: lp.entropy ? lp.entropy[i] : null,
    top: Object.entries(lp.top_logprobs[i] || {}).map(([t, v]) => ({ token: t, logprob: v })).sort((a, b) => b.logprob - a.logprob),
  }));
}

function block(who) {
  const turn = document.createElement("div");
  turn.className = `turn ${who}`;
  if (who !== "doc") {
    const label = document.createElement("div");
    label.className = "who";
    label.textContent = who === "user" ? "you" : "model";
    turn.appendChild(label);
  }
  const text = document.createElement("div");
  text.className = "text";
  turn.appendChild(text);
  $("transcript").appendChild(turn);
  return text;
}
function typed(where, text) {
  const span = document.createElement("span");
  span.className = "typed";
  span.textContent = text;
  where.appendChild(span);
}
function tokenSpan(where, t) {
  const span = document.createElement("span");
  const p = Math.exp(t.logprob);
  span.className = "tok";
  span.textContent = t.token;
  span.dataset.p = String(p);
  span.dataset.index = String(state.tokens.length);
  if (typeof t.entropy === "number") {
    span.dataset.entropy = String(t.entropy);
    span.style.borderBottomWidth = `${Math.min(4, Math.max(0, t.entropy)).toFixed(1)}px`;
  }
  span.style.background = colour(p);
  state.tokens.push(t);
  where.appendChild(span);
  const box = $("transcript");
  box.scrollTop = box.scrollHeight;
}

function showTip(span) {
  const t = state.tokens[Number(span.dataset.index)], tip = $("tip");
  tip.replaceChildren();
  const head = document.createElement("div");
  const tt = document.createElement("span");
  tt.className = "tt";
  tt.textContent = visible(t.token);
  head.append(tt, ` p ${pct(t.logprob)} · logprob ${t.logprob.toFixed(3)}`);
  if (typeof t.entropy === "number") head.append(` · entropy ${t.entropy.toFixed(3)} nats (whole vocabulary)`);
  tip.appendChild(head);
  const table = document.createElement("table");
  for (const alt of t.top) {
    const tr = document.createElement("tr"), name = document.createElement("td"), p = document.createElement("td");
    if (alt.token === t.token) tr.className = "chosen";
    name.className = "alt";
    name.textContent = visible(alt.token);
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = `${Math.round(60 * Math.exp(alt.logprob))}px`;
    p.append(bar, ` ${pct(alt.logprob)}`);
    tr.append(name, p);
    table.appendChild(tr);
  }
  if (t.top.length) tip.appendChild(table);
  tip.hidden = false;
  const r = span.getBoundingClientRect();
  const top = r.bottom + 6 + tip.offsetHeight > innerHeight ? r.top - 6 - tip.offsetHeight : r.bottom + 6;
  tip.style.left = `${Math.max(4, Math.min(r.left, innerWidth - tip.offsetWidth - 4))}px`;
  tip.style.top = `${Math.max(4, top)}px`;
  document.querySelectorAll(".tok.active").forEach((s) => s.classList.remove("active"));
  span.classList.add("active");
}
$("transcript").addEventListener("mouseover", (e) => {
  const span = e.target.closest(".tok");
  if (span) showTip(span);
});
$("transcript").addEventListener("mouseleave", () => { $("tip").hidden = true; });

async function send(event) {
  event.preventDefault();
  if (state.controller) return;
  const text = $("input").value, chat = $("mode").value === "chat";
  if (!text && (chat || !state.doc)) return status("type something first", true);
  const top = Math.max(0, Math.min(5, Number($("top-n").value) || 0));
  const common = { max_tokens: Number($("max-tokens").value) || 64, temperature: Number($("temperature").value),
                   stream: true };
  let url, body, context, where;
  if (chat) {
    state.messages.push({ role: "user", content: text });
    typed(block("user"), text);
    where = block("assistant");
    url = "/v1/chat/completions";
    body = { ...common, messages: state.messages, logprobs: true, top_logprobs: top };
    context = { messages: state.messages.slice() };
  } else {
    state.doc += text;
    where = document.querySelector(".turn.doc .text") || block("doc");
    typed(where, text);
    url = "/v1/completions";
    body = { ...common, prompt: state.doc, logprobs: top };
    context = { prompt: state.doc };
  }
  $("input").value = "";
  state.controller = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  status("generating…");
  let written = "", count = 0, answered = false;
  try {
    const r = await fetch(url, { method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.controller.signal });
    if (!r.ok) throw new Error(await failure(r));
    answered = true;
    Valves.grow({ ...context, completion: "" }, headers());
    for await (const chunk of events(r)) {
      for (const choice of chunk.choices || []) {
        for (const t of tokensOf(choice)) { tokenSpan(where, t); written += t.token; count++; }
        if (choice.finish_reason) status(`${count} tokens · finished: ${choice.finish_reason}`);
      }
      Valves.grow({ ...context, completion: written }, headers());
    }
  } catch (e) {
    status(e.name === "AbortError" ? `stopped after ${count} tokens` : String(e.message || e), e.name !== "AbortError");
  } finally {
    if (answered) Valves.grow({ ...context, completion: written }, headers(), true);
    if (chat) state.messages.push({ role: "assistant", content: written }); else state.doc += written;
    state.controller = null;
    $("send").disabled = false; $("stop").disabled = true;
  }
}

$("composer").addEventListener("submit", send);
$("input").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("send").click(); });
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
function clear() {
  if (state.controller) state.controller.abort();
  Object.assign(state, { doc: "", messages: [], tokens: [] });
  $("transcript").replaceChildren();
  $("tip").hidden = true;
  status("");
  Valves.reset();
}
$("clear").addEventListener("click", clear);
$("mode").addEventListener("change", clear);
$("api-key").addEventListener("change", loadModel);

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (!r.ok) throw new Error(await failure(r));
    const models = await r.json();
    $("model").textContent = models.data.map((m) => m.id).join(", ");
  } catch (e) {
    $("model").textContent = String(e.message || e);
  }
}
loadModel();
