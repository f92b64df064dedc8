// llmgw status page: polls status.json (the document `llmgw ctl status -o json` prints) and
// redraws the tables. Everything a peer reported is set with textContent, never as HTML.
"use strict";

const POLL_MS = 2000;
const token = new URLSearchParams(location.search).get("token") || "";

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function stateBadge(state) {
  const s = String(state || "");
  return el("span", {class: "badge state-" + s.replace(/[^a-z-]/g, ""), "data-field": "state"}, s);
}

function age(seconds) {
  const s = Number(seconds) || 0;
  if (s < 90) return s.toFixed(1) + " s ago";
  if (s < 5400) return Math.round(s / 60) + " min ago";
  return (s / 3600).toFixed(1) + " h ago";
}

function mib(n) {
  return (Number(n) / 1024).toFixed(0) + " GiB";
}

function fillBody(table, rows, emptyText, columns) {
  const body = document.querySelector("#" + table + " tbody");
  const fresh = rows.length ? rows : [el("tr", {class: "empty"}, el("td", {colspan: columns}, emptyText))];
  body.replaceChildren(...fresh);
}

// GPUs connected by NVLink, directly or through others: the groups a tensor-parallel
// replica can use without the PCIe path.
function nvlinkGroups(gpus) {
  const index = new Map(gpus.map((g) => [g.uuid, g.index]));
  const seen = new Set();
  const groups = [];
  for (const g of gpus) {
    if (seen.has(g.uuid)) continue;
    const group = [];
    const todo = [g.uuid];
    seen.add(g.uuid);
    while (todo.length) {
      const u = todo.pop();
      group.push(index.get(u));
      const gpu = gpus.find((x) => x.uuid === u);
      for (const peer of Object.keys((gpu && gpu.nvlink_peers) || {})) {
        if (index.has(peer) && !seen.has(peer)) {
          seen.add(peer);
          todo.push(peer);
        }
      }
    }
    if (group.length > 1) groups.push(group.sort((a, b) => a - b));
  }
  return groups;
}

// Why a GPU is not healthy: every problem, what it waits to release, the processes that
// hold it (pid, command, memory). Text only; set with textContent like the rest.
function gpuNotes(g) {
  const out = [];
  for (const p of g.problems || []) out.push("unhealthy: " + p);
  for (const p of g.soft_problems || []) out.push("takes no new work: " + p);
  if (g.releasing) out.push("releasing: " + g.releasing);
  for (const p of g.processes || []) {
    out.push(`held by pid ${p.pid} (${p.command})` + (p.memory ? `, ${mib(p.memory)}` : ""));
  }
  return out;
}

function nodeRow(n) {
  const sched = [n.cordoned ? "cordoned" : "schedulable"];
  if (n.draining) sched.push("draining");
  if (!n.connected) sched.push("not connected");
  const gpus = el("td", {"data-field": "gpus"});
  for (const g of n.gpus || []) {
    const state = String(g.state || "healthy");
    const line = el("span", {class: "gpu mono gpu-" + state.replace(/[^a-z]/g, ""), "data-gpu-state": state},
      `${g.index}: ${g.name} (${mib(g.memory_free)} free of ${mib(g.memory_total)})`);
    if (state !== "healthy") line.append(" ", stateBadge(state));
    gpus.append(line);
    for (const why of gpuNotes(g)) gpus.append(el("span", {class: "gpu-why muted", "data-field": "gpu-why"}, why));
  }
  if (!(n.gpus || []).length) gpus.append(el("span", {class: "muted"}, "none"));
  const groups = nvlinkGroups(n.gpus || []);
  const fabrics = (n.fabrics || []).map((f) => `${f.name} (${f.state})`).join(", ");
  return el("tr", {"data-node": n.id},
    el("td", {class: "mono"}, n.id),
    el("td", {}, stateBadge(n.state)),
    el("td", {"data-field": "scheduling"}, sched.join(", ")),
    el("td", {"data-field": "heartbeat"}, age(n.heartbeat_age)),
    el("td", {class: "mono"}, n.mgmt_addr, n.kv_relay   // where routers follow its engines' KV-cache events
      ? el("div", {class: "muted", "data-field": "kv-relay"}, "KV relay " + n.kv_relay) : null),
    el("td", {}, fabrics || el("span", {class: "muted"}, "island")),
    gpus,
    el("td", {class: "mono"}, groups.length ? groups.map((gr) => "{" + gr.join(",") + "}").join(" ") : "—"),
    el("td", {}, (n.warnings || []).join("; ")));
}

function replicaRow(r) {
  const ev = r.last_event;
  const last = ev ? `${new Date(ev.ts * 1000).toLocaleTimeString()} ${ev.text}` : "";
  const why = r.reason ? el("div", {class: "muted"}, r.reason) : null;
  // A starting replica's members downloading their weights: bytes on disk and the rate.
  const dl = Object.entries(r.download || {}).map(([node, line]) => `${node}: ${line}`);
  const down = dl.length ? el("div", {class: "muted", "data-field": "download"},
    "downloading " + dl.join("; ")) : null;
  return el("tr", {"data-replica": r.id},
    el("td", {class: "mono"}, r.id),
    el("td", {}, r.deployment),
    el("td", {}, stateBadge(r.state), why, down),
    el("td", {class: "mono"}, (r.nodes || []).join(", ")),
    el("td", {class: "mono"}, (r.gpus || []).join(", ")),
    el("td", {class: "mono", "data-field": "endpoint"}, r.endpoint || ""),
    el("td", {class: "num"}, r.restarts),
    el("td", {"data-field": "last-event"}, last));
}

function deploymentRow(d) {
  return el("tr", {"data-deployment": d.name},
    el("td", {class: "mono"}, d.name),
    el("td", {}, d.model),
    el("td", {}, d.engine),
    el("td", {class: "num", "data-field": "ready"}, `${d.ready}/${d.replicas}`),
    el("td", {}, stateBadge(String(d.status).startsWith("unschedulable") ? "pending" : d.status)));
}

// The last passed pre-flight on the fabric (collective pre-flight; the document's "preflight").
function preflightCell(p) {
  if (!p) return el("td", {"data-field": "preflight"}, el("span", {class: "muted"}, "-"));
  const who = Object.keys(p.members || {}).sort().join(", ");
  return el("td", {"data-field": "preflight"},
    `${Number(p.busbw_gbps).toPrecision(3)} GB/s (${p.replica}: ${who})`);
}

function fabricRow(f, preflight) {
  const models = el("td", {});
  for (const m of f.models || []) {
    const where = [];
    if ((m.shared_stores || []).length) where.push("shared: " + m.shared_stores.join(", "));
    if ((m.local_nodes || []).length) where.push("local on " + m.local_nodes.join(", "));
    models.append(el("div", {}, el("span", {class: "mono"}, m.name), " — " + where.join("; ")));
  }
  if (!(f.models || []).length) models.append(el("span", {class: "muted"}, "no weights seen"));
  const down = (f.down_nodes || []).length ? ` (down on ${f.down_nodes.join(", ")})` : "";
  return el("tr", {"data-fabric": f.name},
    el("td", {class: "mono"}, f.name),
    el("td", {}, (f.nodes || []).join(", ") + down),
    el("td", {class: "num"}, f.gpus),
    models, preflightCell(preflight[f.name]));
}

function render(doc) {
  const nodes = doc.nodes || [];
  const replicas = doc.replicas || [];
  const deployments = doc.deployments || [];
  fillBody("nodes", nodes.map(nodeRow), "no nodes have said Hello", 9);
  fillBody("replicas", replicas.map(replicaRow), "no replicas", 8);
  fillBody("deployments", deployments.map(deploymentRow), "no deployments", 5);
  const preflight = doc.preflight || {};
  fillBody("fabrics", (doc.fabrics || []).map((f) => fabricRow(f, preflight)), "no fabrics", 5);
  const islands = doc.islands || [];
  document.getElementById("islands").textContent = islands.length
    ? "Islands (no fabric; single-node replicas only): " + islands.join(", ") : "";
  // Usage per API key and model (API keys and limits): shown once routers have metered some.
  const usage = doc.usage || [];
  document.getElementById("usage-section").hidden = !usage.length;
  fillBody("usage", usage.map((u) => el("tr", {"data-usage": u.api_key + "/" + u.model},
    el("td", {class: "mono"}, u.api_key || "(no key)"), el("td", {class: "mono"}, u.model || "-"),
    el("td", {class: "num"}, u.requests), el("td", {class: "num"}, u.errors),
    el("td", {class: "num"}, u.prompt_tokens), el("td", {class: "num"}, u.completion_tokens))),
  "no usage", 6);
  const notes = doc.notes || [];
  document.getElementById("notes-section").hidden = !notes.length;
  document.getElementById("notes").replaceChildren(...notes.map((n) => el("li", {}, n)));
  const ready = replicas.filter((r) => r.state === "ready").length;
  document.getElementById("summary").textContent =
    `${nodes.length} nodes, ${deployments.length} deployments, ${ready}/${replicas.length} replicas ready`;
  document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
}

function setConn(ok, text) {
  const c = document.getElementById("conn");
  c.textContent = text;
  c.className = "badge " + (ok ? "conn-live" : "conn-down");
}

async function poll() {
  try {
    const headers = token ? {Authorization: "Bearer " + token} : {};
    const r = await fetch("status.json", {headers, cache: "no-store"});
    if (!r.ok) {
      setConn(false, r.status === 401 ? "token required (add ?token=…)" : "server answered " + r.status);
    } else {
      render(await r.json());
      setConn(true, "live");
    }
  } catch (e) {
    setConn(false, "server unreachable");
  }
  setTimeout(poll, POLL_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  if (token) document.getElementById("json-link").href = "status.json?token=" + encodeURIComponent(token);
  poll();
});
