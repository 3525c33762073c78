// lockstep chat page: conversations in localStorage, answers streamed from
// /v1/chat/completions (server-sent events), markdown with highlighted code, speculation
// counters per answer and a replay that checks the output is the same token for token.
"use strict";

const STORE_KEY = "lockstep.chat.v1";
const SETTINGS_KEY = "lockstep.settings.v1";
const THEME_KEY = "lockstep.theme";
const API_KEY = "lockstep.apiKey"; // sessionStorage: gone when the tab closes

const $ = (id) => document.getElementById(id);
const el = (tag, cls, text) => {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
};

const svg = (d) =>
  '<svg viewBox="0 0 24 24" width="16" height="16" fill="none" stroke="currentColor" stroke-width="1.8" ' +
  'stroke-linecap="round" stroke-linejoin="round" aria-hidden="true">' + d + "</svg>";
const ICONS = {
  pencil: svg('<path d="M12 20h9"/><path d="M16.5 3.5a2.1 2.1 0 0 1 3 3L7 19l-4 1 1-4z"/>'),
  trash: svg('<path d="M3 6h18M8 6V4h8v2M19 6l-1 14H6L5 6M10 11v6M14 11v6"/>'),
  sun: svg('<circle cx="12" cy="12" r="4"/><path d="M12 2v2M12 20v2M4.9 4.9l1.4 1.4M17.7 17.7l1.4 1.4M2 12h2M20 12h2M4.9 19.1l1.4-1.4M17.7 6.3l1.4-1.4"/>'),
  moon: svg('<path d="M21 12.8A9 9 0 1 1 11.2 3a7 7 0 0 0 9.8 9.8z"/>'),
};

// ---------------------------------------------------------------------------------------
// State

const state = {
  convs: [],          // [{id, title, updated, messages: [...]}], newest first
  current: null,      // id of the open conversation
  settings: {},
  server: { model: null, speculation: false, up: false },
  busy: null,         // {controller, msg} while an answer streams
  pendingRetry: null, // a send to retry once an API key is given
};

function uid() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE_KEY) || "null");
    if (saved && Array.isArray(saved.convs)) {
      state.convs = saved.convs;
      state.current = saved.current;
    }
  } catch (_) { /* a corrupt store starts afresh */ }
  try {
    state.settings = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}") || {};
  } catch (_) {
    state.settings = {};
  }
  // An answer that was streaming when the page went away is kept as it stood.
  for (const c of state.convs) {
    for (const m of c.messages) {
      if (m.streaming) { m.streaming = false; m.stopped = true; }
    }
  }
}

function save() {
  try {
    localStorage.setItem(STORE_KEY, JSON.stringify({ convs: state.convs, current: state.current }));
  } catch (e) {
    showHint("could not save the conversation: " + e.message);
  }
}

function saveSettings() {
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(state.settings));
}

function conv() {
  return state.convs.find((c) => c.id === state.current) || null;
}

function newConv() {
  const c = { id: uid(), title: "New chat", updated: Date.now(), messages: [] };
  state.convs.unshift(c);
  state.current = c.id;
  save();
  return c;
}

// ---------------------------------------------------------------------------------------
// Markdown (escaped first: model text never becomes markup)

function esc(s) {
  return s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function inline(text) {
  // Code spans first, so their content is left alone.
  const parts = text.split(/(`[^`\n]+`)/g);
  return parts.map((p) => {
    if (p.length > 1 && p.startsWith("`") && p.endsWith("`")) return "<code>" + esc(p.slice(1, -1)) + "</code>";
    let s = esc(p);
    s = s.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>");
    s = s.replace(/(^|[^*\w])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>");
    s = s.replace(/(^|[^_\w])_([^_\n]+)_(?!\w)/g, "$1<em>$2</em>");
    s = s.replace(/\[([^\]\n]+)\]\((https?:\/\/[^)\s]+)\)/g, '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
    return s;
  }).join("");
}

function renderBlocks(text) {
  const lines = text.split("\n");
  let html = "";
  let para = [];
  let list = null; // {type, items}
  const flushPara = () => {
    if (para.length) html += "<p>" + para.map(inline).join("<br>") + "</p>";
    para = [];
  };
  const flushList = () => {
    if (list) html += `<${list.type}>` + list.items.map((i) => "<li>" + inline(i) + "</li>").join("") + `</${list.type}>`;
    list = null;
  };
  for (const line of lines) {
    let m;
    if (!line.trim()) { flushPara(); flushList(); continue; }
    if ((m = /^(#{1,4})\s+(.*)$/.exec(line))) {
      flushPara(); flushList();
      const n = m[1].length;
      html += `<h${n}>` + inline(m[2]) + `</h${n}>`;
    } else if (/^\s*([-*_])\s*\1\s*\1[\s\-*_]*$/.test(line)) {
      flushPara(); flushList();
      html += "<hr>";
    } else if ((m = /^\s*[-*+]\s+(.*)$/.exec(line))) {
      flushPara();
      if (!list || list.type !== "ul") { flushList(); list = { type: "ul", items: [] }; }
      list.items.push(m[1]);
    } else if ((m = /^\s*\d+[.)]\s+(.*)$/.exec(line))) {
      flushPara();
      if (!list || list.type !== "ol") { flushList(); list = { type: "ol", items: [] }; }
      list.items.push(m[1]);
    } else if ((m = /^>\s?(.*)$/.exec(line))) {
      flushPara(); flushList();
      html += "<blockquote>" + inline(m[1]) + "</blockquote>";
    } else if (list && /^\s{2,}\S/.test(line)) {
      list.items[list.items.length - 1] += " " + line.trim();
    } else {
      flushList();
      para.push(line);
    }
  }
  flushPara(); flushList();
  return html;
}

/** Markdown to HTML: fenced code blocks (an unterminated fence runs to the end, as while
 * streaming) and the common block and inline forms. */
function markdown(text) {
  let html = "";
  const fence = /^ {0,3}(```+|~~~+)\s*([\w+#.-]*)[^\n]*$/;
  const lines = text.split("\n");
  let buf = [];
  let code = null; // {marker, lang, lines}
  for (const line of lines) {
    if (code) {
      if (line.trim().startsWith(code.marker) && line.trim().replace(/[`~]/g, "") === "") {
        html += codeBlock(code.lines.join("\n"), code.lang);
        code = null;
      } else {
        code.lines.push(line);
      }
      continue;
    }
    const m = fence.exec(line);
    if (m) {
      html += renderBlocks(buf.join("\n"));
      buf = [];
      code = { marker: m[1], lang: m[2].toLowerCase(), lines: [] };
    } else {
      buf.push(line);
    }
  }
  html += renderBlocks(buf.join("\n"));
  if (code) html += codeBlock(code.lines.join("\n"), code.lang);
  return html;
}

// ---------------------------------------------------------------------------------------
// A small highlighter: comments, strings, numbers, keywords, literals, calls

const KEYWORDS = {
  js: "async await break case catch class const continue default delete do else export extends finally for from function if import in instanceof let new of return static super switch this throw try typeof var void while with yield",
  py: "and as assert async await break class continue def del elif else except finally for from global if import in is lambda nonlocal not or pass raise return try while with yield match case self",
  rust: "as async await break const continue crate dyn else enum extern fn for if impl in let loop match mod move mut pub ref return self Self static struct super trait type unsafe use where while",
  c: "auto break case char const continue default do double else enum extern float for goto if inline int long register return short signed sizeof static struct switch typedef union unsigned void volatile while class namespace public private protected template typename virtual using new delete bool",
  go: "break case chan const continue default defer else fallthrough for func go goto if import interface map package range return select struct switch type var",
  sh: "if then else elif fi for while do done case esac in function return export local echo exit set",
  sql: "select from where insert into values update set delete create table drop alter join left right inner outer on group by order having limit as and or not null primary key",
};
const LITERALS = "true false null undefined None True False nil NULL";
const LANG_ALIASES = {
  javascript: "js", ts: "js", typescript: "js", jsx: "js", tsx: "js", json: "json", python: "py", py3: "py",
  rs: "rust", cpp: "c", "c++": "c", h: "c", hpp: "c", java: "c", cs: "c", csharp: "c", kotlin: "c", swift: "c",
  golang: "go", bash: "sh", shell: "sh", zsh: "sh", console: "sh",
};

function highlight(code, lang) {
  const l = LANG_ALIASES[lang] || lang;
  const hashComments = l === "py" || l === "sh" || lang === "yaml" || lang === "toml" || lang === "ruby";
  const kw = new Set((KEYWORDS[l] || (l === "json" ? "" : KEYWORDS.js)).split(" "));
  const lit = new Set(LITERALS.split(" "));
  const re = new RegExp(
    [
      hashComments ? "#[^\\n]*" : "\\/\\/[^\\n]*|\\/\\*[\\s\\S]*?(?:\\*\\/|$)",
      l === "sql" ? "--[^\\n]*" : null,
      l === "py" ? '"""[\\s\\S]*?(?:"""|$)' : null,
      '"(?:[^"\\\\\\n]|\\\\.)*"?',
      "'(?:[^'\\\\\\n]|\\\\.)*'?",
      "`(?:[^`\\\\]|\\\\.)*`?",
      "\\b\\d[\\d_]*(?:\\.\\d+)?(?:[eE][+-]?\\d+)?\\w*\\b|\\b0x[\\da-fA-F]+\\b",
      "[A-Za-z_$][\\w$]*",
    ].filter(Boolean).join("|"),
    "g",
  );
  let out = "";
  let last = 0;
  let m;
  while ((m = re.exec(code))) {
    const t = m[0];
    out += esc(code.slice(last, m.index));
    last = m.index + t.length;
    const c = t[0];
    let cls = null;
    if (c === "/" || c === "#" || (c === "-" && l === "sql")) cls = "tk-com";
    else if (c === '"' || c === "'" || c === "`") {
      // A JSON key is a string followed by a colon.
      cls = l === "json" && /^\s*:/.test(code.slice(last)) ? "tk-key" : "tk-str";
    } else if (/\d/.test(c)) cls = "tk-num";
    else if (lit.has(t)) cls = "tk-lit";
    else if (kw.has(l === "sql" ? t.toLowerCase() : t)) cls = "tk-kw";
    else if (/^\s*\(/.test(code.slice(last))) cls = "tk-fn";
    out += cls ? `<span class="${cls}">${esc(t)}</span>` : esc(t);
    if (t.length === 0) re.lastIndex++;
  }
  return out + esc(code.slice(last));
}

function codeBlock(code, lang) {
  return (
    '<div class="code"><div class="code-head"><span>' + esc(lang || "text") +
    '</span><button class="copy" type="button" data-copy>Copy</button></div><pre><code>' +
    highlight(code, lang) + "</code></pre></div>"
  );
}

// ---------------------------------------------------------------------------------------
// Rendering

/** Splits `<think>…</think>` out of content: [reasoning, answer, still thinking]. */
function splitThink(content) {
  const open = content.indexOf("<think>");
  if (open === -1) return ["", content, false];
  const close = content.indexOf("</think>", open);
  if (close === -1) return [content.slice(open + 7), content.slice(0, open), true];
  return [content.slice(open + 7, close), content.slice(0, open) + content.slice(close + 8), false];
}

function fmtMs(ms) {
  if (ms < 1000) return Math.round(ms) + " ms";
  return (ms / 1000).toFixed(ms < 10000 ? 2 : 1) + " s";
}

function statsItems(s) {
  const items = [];
  if (s.tps !== undefined) items.push(["stat tps", s.tps.toFixed(1) + " tok/s"]);
  if (s.ttft !== undefined) items.push(["stat ttft", "TTFT " + fmtMs(s.ttft)]);
  if (s.tokens !== undefined) items.push(["stat", s.tokens + " tokens"]);
  if (s.spec) {
    const sp = s.spec;
    const rate = sp.drafted ? Math.round((100 * sp.accepted) / sp.drafted) + "%" : "–";
    items.push(["stat spec", `drafted ${sp.drafted} · accepted ${sp.accepted} (${rate})`]);
    // The estimate is negative when drafting cost more than it saved.
    const saved = sp.time_saved_ms || 0;
    items.push(["stat spec", saved >= 0 ? "saved " + fmtMs(saved) : "cost " + fmtMs(-saved)]);
  } else if (s.tokens !== undefined) {
    items.push(["stat", "no speculation"]);
  }
  if (s.seed !== undefined) items.push(["stat", "seed " + s.seed]);
  return items;
}

function renderAssistantBody(m, body) {
  body.textContent = "";
  const reasoningText = (m.reasoning || "") + splitThink(m.content || "")[0];
  const [, answer, thinking] = splitThink(m.content || "");
  if (reasoningText.trim()) {
    const d = el("details", "reasoning");
    d.open = m.streaming && (thinking || !answer.trim());
    const sum = el("summary", null, m.streaming && (thinking || !answer.trim()) ? "Thinking…" : "Reasoning");
    d.append(sum, el("div", "thought", reasoningText.trim()));
    body.append(d);
  }
  for (const call of m.tool_calls || []) {
    const box = el("div", "tool-call");
    const head = el("div", "tool-head");
    head.append(el("span", "tag", "Tool call"), el("b", null, call.name || "…"));
    box.append(head);
    let args = call.arguments || "";
    try { args = JSON.stringify(JSON.parse(args), null, 2); } catch (_) { /* partial */ }
    box.insertAdjacentHTML("beforeend", codeBlock(args, "json"));
    body.append(box);
  }
  const text = el("div", "text");
  if (m.json && !m.streaming) {
    let pretty = null;
    try { pretty = JSON.stringify(JSON.parse(answer), null, 2); } catch (_) { /* shown raw */ }
    if (pretty !== null) {
      text.innerHTML = codeBlock(pretty, "json");
      text.firstChild.classList.add("json-result");
    } else {
      text.innerHTML = codeBlock(answer, "json");
      if (answer.trim()) text.append(el("div", "note-line", "not complete JSON (the answer was cut off)"));
    }
  } else {
    text.innerHTML = markdown(answer);
  }
  if (m.streaming) text.classList.add("cursor");
  body.append(text);
}

function messageNode(m, index) {
  const node = el("div", "msg " + m.role);
  node.dataset.index = index;
  if (m.role === "user") {
    node.append(el("div", "bubble", m.content));
    return node;
  }
  const role = el("div", "role", state.server.model || "assistant");
  if (m.json) role.append(el("span", "badge", "JSON"));
  const body = el("div", "body");
  renderAssistantBody(m, body);
  node.append(role, body);
  if (m.stopped) node.append(el("div", "note-line stopped", "Stopped."));
  else if (m.finish_reason === "length" && !m.streaming) {
    node.append(el("div", "note-line", "Cut off at the max-tokens limit (Settings)."));
  }
  if (m.error) {
    const err = el("div", "error");
    err.append(el("span", "msg-text", m.error));
    if (!m.streaming && index === conv().messages.length - 1) {
      const retry = el("button", "btn subtle", "Retry");
      retry.type = "button";
      retry.addEventListener("click", () => retryLast());
      err.append(retry);
    }
    node.append(err);
  }
  if (!m.streaming && (m.stats || m.content || (m.tool_calls || []).length)) {
    const meta = el("div", "meta");
    const stats = el("div", "stats speculation-line");
    for (const [cls, t] of statsItems(m.stats || {})) stats.append(el("span", cls, t));
    meta.append(stats);
    const actions = el("div", "actions");
    const copy = el("button", "act", "Copy");
    copy.type = "button";
    copy.addEventListener("click", () => copyText(splitThink(m.content || "")[1], copy));
    actions.append(copy);
    if (m.request && !m.stopped && !m.error) {
      const replay = el("button", "act replay-btn", "Replay");
      replay.type = "button";
      replay.title = state.server.speculation
        ? "Resend the same request with the same seed, speculation switched the other way, and compare"
        : "Resend the same request with the same seed and compare";
      replay.addEventListener("click", () => replayMessage(m));
      actions.append(replay);
    }
    meta.append(actions);
    node.append(meta);
  }
  if (m.replay) {
    const r = m.replay;
    let cls = "replay running";
    let text = "Replaying…";
    if (r.error) { cls = "replay differs"; text = "Replay failed: " + r.error; }
    else if (r.done) {
      const how = !state.server.speculation ? "" : r.speculation ? " with speculation" : " without speculation";
      const rate = r.stats && r.stats.tps !== undefined ? r.stats.tps.toFixed(1) + " tok/s" : "";
      const tps = rate || how ? ` (${rate}${how})` : "";
      cls = r.identical ? "replay same" : "replay differs";
      text = (r.identical ? "✓ Replay identical" : "✗ Replay differs") + tps;
    }
    node.append(el("div", cls, text));
  }
  return node;
}

function renderMessages() {
  const box = $("messages");
  const c = conv();
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
  box.querySelectorAll(".msg").forEach((n) => n.remove());
  const msgs = c ? c.messages : [];
  $("empty").hidden = msgs.length > 0;
  msgs.forEach((m, i) => box.append(messageNode(m, i)));
  if (atBottom || state.busy) box.scrollTop = box.scrollHeight;
}

/** Re-renders only the message being streamed (cheap per chunk). */
function renderStreaming(m) {
  const c = conv();
  if (!c) return;
  const i = c.messages.indexOf(m);
  const old = $("messages").querySelector(`.msg[data-index="${i}"]`);
  if (!old) return renderMessages();
  const box = $("messages");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 120;
  old.replaceWith(messageNode(m, i));
  if (atBottom) box.scrollTop = box.scrollHeight;
}

function renderSidebar() {
  const nav = $("conversations");
  nav.textContent = "";
  for (const c of state.convs) {
    const row = el("div", "conv" + (c.id === state.current ? " active" : ""));
    row.dataset.id = c.id;
    const title = el("div", "conv-title", c.title);
    title.title = c.title;
    const rename = el("button", "mini rename");
    rename.innerHTML = ICONS.pencil;
    rename.type = "button";
    rename.title = "Rename";
    rename.setAttribute("aria-label", "Rename conversation");
    const del = el("button", "mini delete");
    del.innerHTML = ICONS.trash;
    del.type = "button";
    del.title = "Delete";
    del.setAttribute("aria-label", "Delete conversation");
    row.append(title, rename, del);
    row.addEventListener("click", (e) => {
      if (e.target.closest("button") || e.target.tagName === "INPUT") return;
      select(c.id);
    });
    title.addEventListener("dblclick", () => startRename(c, title));
    rename.addEventListener("click", (e) => { e.stopPropagation(); startRename(c, title); });
    del.addEventListener("click", (e) => {
      e.stopPropagation(); // (arming replaces the icon the click came from)
      if (!del.classList.contains("armed")) {
        del.classList.add("armed");
        del.textContent = "Delete?";
        setTimeout(() => { del.classList.remove("armed"); del.innerHTML = ICONS.trash; }, 3000);
        return;
      }
      removeConv(c.id);
    });
    nav.append(row);
  }
  const c = conv();
  $("chat-title").textContent = c ? c.title : "New chat";
  document.title = (c && c.messages.length ? c.title + " · " : "") + "lockstep";
}

function startRename(c, titleNode) {
  const input = el("input");
  input.value = c.title;
  input.setAttribute("aria-label", "Conversation name");
  titleNode.textContent = "";
  titleNode.append(input);
  input.focus();
  input.select();
  let done = false;
  const finish = (keep) => {
    if (done) return;
    done = true;
    const v = input.value.trim();
    if (keep && v) { c.title = v.slice(0, 120); c.renamed = true; save(); }
    renderSidebar();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") { e.preventDefault(); finish(true); }
    if (e.key === "Escape") { e.preventDefault(); e.stopPropagation(); finish(false); }
  });
  input.addEventListener("blur", () => finish(true));
}

function removeConv(id) {
  if (state.busy && state.current === id) stop();
  state.convs = state.convs.filter((c) => c.id !== id);
  if (state.current === id) state.current = state.convs.length ? state.convs[0].id : null;
  save();
  renderSidebar();
  renderMessages();
}

function select(id) {
  if (state.busy) stop();
  state.current = id;
  save();
  renderSidebar();
  renderMessages();
  document.querySelector(".app").classList.remove("nav-open");
  $("input").focus();
}

function showHint(t) {
  $("composer-hint").textContent = t || "";
}

function copyText(text, button) {
  const done = () => {
    const old = button.textContent;
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = old; }, 1200);
  };
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(text).then(done, () => fallbackCopy(text, done));
  } else {
    fallbackCopy(text, done);
  }
}

function fallbackCopy(text, done) {
  const ta = el("textarea");
  ta.value = text;
  ta.style.position = "fixed";
  ta.style.opacity = "0";
  document.body.append(ta);
  ta.select();
  try { document.execCommand("copy"); done(); } catch (_) { /* nothing to do */ }
  ta.remove();
}

// ---------------------------------------------------------------------------------------
// Requests

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(API_KEY);
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function num(v) {
  if (v === undefined || v === null || v === "") return undefined;
  const n = Number(v);
  return Number.isFinite(n) ? n : undefined;
}

/** The request body for the open conversation (everything up to, not including, `upto`). */
function buildRequest(c, upto) {
  const s = state.settings;
  const messages = [];
  if (s.system && s.system.trim()) messages.push({ role: "system", content: s.system });
  for (const m of c.messages.slice(0, upto)) {
    if (m.role === "user") messages.push({ role: "user", content: m.content });
    else if (!m.error && m.content) messages.push({ role: "assistant", content: splitThink(m.content)[1] });
  }
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  const t = num(s.temperature); if (t !== undefined) body.temperature = t;
  const p = num(s.top_p); if (p !== undefined) body.top_p = p;
  const seed = num(s.seed); if (seed !== undefined) body.seed = Math.trunc(seed);
  body.max_tokens = Math.trunc(num(s.max_tokens) || 512);
  if (state.server.speculation && s.speculation === false) body.speculation = false;
  if ($("json-mode").checked) {
    const schema = (s.schema || "").trim();
    if (schema) {
      let parsed;
      try { parsed = JSON.parse(schema); } catch (e) { throw new Error("the JSON Schema in Settings is not valid JSON: " + e.message); }
      body.response_format = { type: "json_schema", json_schema: { name: "schema", schema: parsed, strict: true } };
    } else {
      body.response_format = { type: "json_object" };
    }
  }
  const tools = (s.tools || "").trim();
  if (tools) {
    let parsed;
    try { parsed = JSON.parse(tools); } catch (e) { throw new Error("the tools in Settings are not valid JSON: " + e.message); }
    if (!Array.isArray(parsed)) throw new Error("the tools in Settings must be a JSON array");
    if (parsed.length) body.tools = parsed;
  }
  return body;
}

/** Posts `body` and streams the answer into `m`; `onChunk` re-renders. Resolves when done. */
async function stream(body, m, controller, onChunk) {
  const t0 = performance.now();
  let tFirst = null;
  const resp = await fetch("/v1/chat/completions", {
    method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
  });
  if (!resp.ok) {
    let message = `HTTP ${resp.status}`;
    try {
      const j = await resp.json();
      if (j && j.error && j.error.message) message = j.error.message + (j.error.param ? ` (${j.error.param})` : "");
    } catch (_) { /* not JSON */ }
    const err = new Error(message);
    err.status = resp.status;
    throw err;
  }
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  let usage = null;
  const calls = [];
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.search(/\r?\n\r?\n/)) !== -1) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (!data) continue; // a keep-alive comment
      if (data === "[DONE]") { reader.cancel().catch(() => {}); break; }
      let j;
      try { j = JSON.parse(data); } catch (_) { continue; }
      if (j.error) throw new Error(j.error.message || "the server reported an error");
      if (j.seed !== undefined && m.seed === undefined) m.seed = j.seed;
      if (j.usage) usage = j.usage;
      for (const ch of j.choices || []) {
        const d = ch.delta || {};
        let got = false;
        if (d.content) { m.content += d.content; got = true; }
        if (d.reasoning_content) { m.reasoning = (m.reasoning || "") + d.reasoning_content; got = true; }
        for (const tc of d.tool_calls || []) {
          const slot = calls[tc.index] || (calls[tc.index] = { name: "", arguments: "" });
          const f = tc.function || tc.custom || {};
          if (f.name) slot.name = f.name;
          if (f.arguments) slot.arguments += f.arguments;
          if (f.input) slot.arguments += f.input;
          got = true;
        }
        if (calls.length) m.tool_calls = calls.filter(Boolean);
        if (ch.finish_reason) m.finish_reason = ch.finish_reason;
        if (got && tFirst === null) tFirst = performance.now();
      }
      onChunk();
    }
  }
  const tEnd = performance.now();
  const stats = { seed: m.seed };
  if (tFirst !== null) stats.ttft = tFirst - t0;
  if (usage) {
    stats.tokens = usage.completion_tokens;
    const decodeS = (tEnd - (tFirst ?? t0)) / 1000;
    // The first token came with the time to first token; the rest took the decode time.
    if (usage.completion_tokens > 1 && decodeS > 0) stats.tps = (usage.completion_tokens - 1) / decodeS;
    if (usage.speculative) stats.spec = usage.speculative;
  }
  m.stats = stats;
}

function setBusy(b) {
  $("send").hidden = !!b;
  $("stop").hidden = !b;
}

async function send(text) {
  let c = conv() || newConv();
  if (text !== null) {
    c.messages.push({ role: "user", content: text });
    if (!c.renamed && c.messages.filter((m) => m.role === "user").length === 1) {
      const t = text.replace(/\s+/g, " ").trim();
      c.title = (t.length > 48 ? t.slice(0, 47).trimEnd() + "…" : t) || "New chat";
    }
  }
  let body;
  try {
    body = buildRequest(c, c.messages.length);
  } catch (e) {
    showHint(e.message);
    c.messages.pop();
    return;
  }
  showHint("");
  const m = { role: "assistant", content: "", streaming: true, json: !!body.response_format };
  c.messages.push(m);
  c.updated = Date.now();
  state.convs = [c, ...state.convs.filter((x) => x !== c)];
  save();
  renderSidebar();
  renderMessages();
  const controller = new AbortController();
  state.busy = { controller, msg: m };
  setBusy(true);
  let last = 0;
  try {
    await stream(body, m, controller, () => {
      const now = performance.now();
      if (now - last > 30) { last = now; renderStreaming(m); }
    });
    // Kept for replay: the same body with the seed the server used.
    m.request = { ...body, seed: m.seed };
  } catch (e) {
    if (e.name === "AbortError") {
      m.stopped = true;
    } else {
      m.error = e.message;
      if (e.status === 401) {
        state.pendingRetry = true;
        askKey(sessionStorage.getItem(API_KEY) ? "That key was refused." : "");
      }
    }
  } finally {
    m.streaming = false;
    state.busy = null;
    setBusy(false);
    save();
    renderMessages();
  }
}

function stop() {
  if (state.busy) state.busy.controller.abort();
}

function retryLast() {
  const c = conv();
  if (!c || state.busy) return;
  const last = c.messages[c.messages.length - 1];
  if (last && last.role === "assistant") c.messages.pop();
  send(null);
}

async function replayMessage(m) {
  if (state.busy || !m.request) return;
  const body = { ...m.request };
  const wasSpec = !!(m.stats && m.stats.spec);
  if (state.server.speculation) body.speculation = !wasSpec;
  const r = { content: "", streaming: true };
  m.replay = { done: false };
  renderMessages();
  const controller = new AbortController();
  state.busy = { controller, msg: r };
  setBusy(true);
  try {
    await stream(body, r, controller, () => {});
    const same = r.content === m.content &&
      (r.reasoning || "") === (m.reasoning || "") &&
      JSON.stringify(r.tool_calls || []) === JSON.stringify(m.tool_calls || []) &&
      (r.finish_reason || "") === (m.finish_reason || "");
    m.replay = { done: true, identical: same, speculation: !!(r.stats && r.stats.spec), stats: r.stats };
  } catch (e) {
    m.replay = { done: true, error: e.name === "AbortError" ? "stopped" : e.message };
  } finally {
    state.busy = null;
    setBusy(false);
    save();
    renderMessages();
  }
}

// ---------------------------------------------------------------------------------------
// API key

function askKey(error) {
  const d = $("key-dialog");
  $("key-error").hidden = !error;
  $("key-error").textContent = error || "";
  $("key-input").value = "";
  if (!d.open) d.showModal();
  $("key-input").focus();
}

function keySaved() {
  const v = $("key-input").value.trim();
  if (!v) return;
  sessionStorage.setItem(API_KEY, v);
  $("key-dialog").close();
  $("forget-key").hidden = false;
  if (state.pendingRetry) {
    state.pendingRetry = null;
    retryLast();
  }
}

// ---------------------------------------------------------------------------------------
// Server, settings, theme

async function probeServer() {
  const info = $("server-info");
  try {
    const r = await fetch("/health", { cache: "no-store" });
    const j = await r.json();
    state.server = { model: j.model, speculation: !!j.speculation, up: true };
    info.innerHTML = "";
    info.append(el("span", "dot up"), el("span", null, j.model));
  } catch (_) {
    state.server.up = false;
    info.innerHTML = "";
    info.append(el("span", "dot down"), el("span", null, "server unreachable"));
  }
  updateSpecUi();
  renderMessages();
}

function updateSpecUi() {
  const badge = $("spec-badge");
  const box = $("set-speculation");
  badge.hidden = !state.server.up;
  if (state.server.speculation) {
    const on = state.settings.speculation !== false;
    badge.textContent = on ? "speculation on" : "speculation off";
    badge.className = "badge" + (on ? "" : " off");
    box.disabled = false;
    box.checked = on;
    $("spec-note").textContent = "Drafts tokens and verifies them in one batch; the output is identical to plain decoding.";
  } else {
    badge.textContent = "plain decoding";
    badge.className = "badge off";
    box.disabled = true;
    box.checked = false;
    $("spec-note").textContent = "This server was started without speculation (lockstep serve --ngram, --draft MODEL or --spec auto).";
  }
}

const SETTING_FIELDS = [
  ["set-system", "system"], ["set-temperature", "temperature"], ["set-top-p", "top_p"],
  ["set-seed", "seed"], ["set-max-tokens", "max_tokens"], ["set-schema", "schema"], ["set-tools", "tools"],
];

function bindSettings() {
  for (const [id, key] of SETTING_FIELDS) {
    const input = $(id);
    input.value = state.settings[key] ?? "";
    input.addEventListener("input", () => { state.settings[key] = input.value; saveSettings(); });
  }
  // A schema or tool list that parses is laid out readably when the field is left.
  for (const id of ["set-schema", "set-tools"]) {
    $(id).addEventListener("blur", () => {
      const input = $(id);
      try {
        const pretty = JSON.stringify(JSON.parse(input.value), null, 2);
        if (pretty !== input.value) {
          input.value = pretty;
          input.dispatchEvent(new Event("input"));
        }
      } catch (_) { /* left as typed; the send reports the error */ }
    });
  }
  $("set-speculation").addEventListener("change", (e) => {
    state.settings.speculation = e.target.checked;
    saveSettings();
    updateSpecUi();
  });
  $("json-mode").checked = !!state.settings.json_mode;
  $("json-mode").addEventListener("change", (e) => { state.settings.json_mode = e.target.checked; saveSettings(); });
  const toggle = (open) => { $("settings").hidden = !open; };
  $("open-settings").addEventListener("click", () => toggle($("settings").hidden));
  $("close-settings").addEventListener("click", () => toggle(false));
  $("forget-key").hidden = !sessionStorage.getItem(API_KEY);
  $("forget-key").addEventListener("click", () => { sessionStorage.removeItem(API_KEY); $("forget-key").hidden = true; });
}

function applyTheme(t) {
  const theme = t || (matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light");
  document.documentElement.dataset.theme = theme;
  $("theme").innerHTML = theme === "dark" ? ICONS.sun : ICONS.moon;
  $("theme").title = theme === "dark" ? "Light theme" : "Dark theme";
}

// ---------------------------------------------------------------------------------------
// Start

function autosize() {
  const ta = $("input");
  ta.style.height = "auto";
  ta.style.height = Math.min(ta.scrollHeight, window.innerHeight * 0.4) + "px";
}

function submit() {
  if (state.busy) return;
  const text = $("input").value;
  if (!text.trim()) return;
  $("input").value = "";
  autosize();
  send(text);
}

function init() {
  load();
  applyTheme(localStorage.getItem(THEME_KEY));
  bindSettings();
  if (!conv() && state.convs.length) state.current = state.convs[0].id;
  renderSidebar();
  renderMessages();
  probeServer();

  $("composer").addEventListener("submit", (e) => { e.preventDefault(); submit(); });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); submit(); }
  });
  $("input").addEventListener("input", autosize);
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", () => {
    if (state.busy) stop();
    const c = conv();
    if (!c || c.messages.length) newConv();
    renderSidebar();
    renderMessages();
    document.querySelector(".app").classList.remove("nav-open");
    $("input").focus();
  });
  $("theme").addEventListener("click", () => {
    const next = document.documentElement.dataset.theme === "dark" ? "light" : "dark";
    localStorage.setItem(THEME_KEY, next);
    applyTheme(next);
  });
  $("menu").addEventListener("click", () => document.querySelector(".app").classList.toggle("nav-open"));
  $("scrim").addEventListener("click", () => document.querySelector(".app").classList.remove("nav-open"));
  $("messages").addEventListener("click", (e) => {
    const b = e.target.closest("[data-copy]");
    if (b) copyText(b.closest(".code").querySelector("code").textContent, b);
  });
  $("key-form").addEventListener("submit", (e) => { e.preventDefault(); keySaved(); });
  $("key-cancel").addEventListener("click", () => { state.pendingRetry = null; $("key-dialog").close(); });
  document.addEventListener("keydown", (e) => {
    if (e.key !== "Escape") return;
    if (state.busy) { e.preventDefault(); stop(); return; }
    if (!$("settings").hidden) $("settings").hidden = true;
  });
  $("input").focus();
}

init();
