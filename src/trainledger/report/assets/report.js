/* trainledger report: draws the data embedded in #trainledger-data. Plain JavaScript, nothing fetched.
 *
 * Sections: summary (peak and breakdown), timeline (stacked live bytes by category over the event clock,
 * phase bands, the peak marked; hover or click an instant for the arrays live then), every entry (sortable),
 * bars (per rank, a plan against its budget), the peak-against-extra-compute curve, the command's tables.
 * After drawing, <body data-status> is "ok", or "error" with the messages in window.__errors and #errors.
 */
(function () {
  "use strict";

  var errors = (window.__errors = window.__errors || []);
  window.addEventListener("error", function (ev) {
    errors.push(String(ev.message || ev));
    finish();
  });

  var SVGNS = "http://www.w3.org/2000/svg";
  var DATA = JSON.parse(document.getElementById("trainledger-data").textContent);
  var CATS = DATA.categories;
  var PAGE = 200; // table rows drawn at a time

  // --- formatting ----------------------------------------------------------------------------------------

  function fmtInt(n) {
    if (n === null || n === undefined) return "-";
    var s = String(Math.round(Math.abs(n))).replace(/\B(?=(\d{3})+(?!\d))/g, ",");
    return n < 0 ? "-" + s : s;
  }

  function scaled(n, base, units) {
    var v = Math.abs(n), i = 0;
    while (v >= base && i < units.length - 1) { v /= base; i++; }
    return (n < 0 ? "-" : "") + (i === 0 ? String(Math.round(v)) : v.toFixed(2)) + " " + units[i];
  }

  // Decimal and binary, labelled, as the terminal prints them: "11.53 MB / 11.00 MiB".
  function bothUnits(n) {
    if (Math.abs(n) < 1000) return n + " B";
    return scaled(n, 1000, ["B", "kB", "MB", "GB", "TB"]) + " / " + scaled(n, 1024, ["B", "KiB", "MiB", "GiB", "TiB"]);
  }

  function fmtBytes(n) {
    if (n === null || n === undefined) return "-";
    return fmtInt(n) + " bytes" + (Math.abs(n) >= 1000 ? " (" + bothUnits(n) + ")" : "");
  }

  var BINARY = [[Math.pow(2, 40), "TiB", 40], [Math.pow(2, 30), "GiB", 30], [Math.pow(2, 20), "MiB", 20],
    [1024, "KiB", 10], [1, "B", 0]];

  function binaryUnit(maxBytes) {
    for (var i = 0; i < BINARY.length; i++) if (maxBytes >= BINARY[i][0]) return BINARY[i];
    return BINARY[BINARY.length - 1];
  }

  function niceStep(span, count) {
    var raw = span / Math.max(count, 1);
    if (!(raw > 0)) return 1;
    var p = Math.pow(10, Math.floor(Math.log10(raw)));
    var m = raw / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * p;
  }

  function trimNum(v, step) {
    var decimals = step >= 1 ? 0 : Math.min(6, Math.ceil(-Math.log10(step)));
    return v.toFixed(decimals);
  }

  // --- DOM helpers ---------------------------------------------------------------------------------------

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    setAttrs(node, attrs);
    append(node, children);
    return node;
  }

  function svgEl(tag, attrs, children) {
    var node = document.createElementNS(SVGNS, tag);
    setAttrs(node, attrs);
    append(node, children);
    return node;
  }

  function setAttrs(node, attrs) {
    if (!attrs) return;
    Object.keys(attrs).forEach(function (k) {
      if (attrs[k] === null || attrs[k] === undefined) return;
      if (k === "text") node.textContent = attrs[k];
      else node.setAttribute(k, attrs[k]);
    });
  }

  function append(node, children) {
    if (children === null || children === undefined) return;
    if (!Array.isArray(children)) children = [children];
    children.forEach(function (c) {
      if (c === null || c === undefined) return;
      node.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    });
  }

  function swatch(color) {
    return el("span", { class: "swatch", style: "background:" + color, "aria-hidden": "true" });
  }

  function section(root, id, title) {
    var s = el("section", { id: id, "aria-labelledby": id + "-title" });
    s.appendChild(el("h2", { id: id + "-title", text: title }));
    root.appendChild(s);
    return s;
  }

  // --- sortable tables ------------------------------------------------------------------------------------

  function cellText(value, type) {
    if (value === null || value === undefined) return "-";
    if (type === "bytes" || type === "int") return fmtInt(value);
    if (type === "float") return Number(value).toFixed(3);
    if (type === "pct") return (100 * value >= 0 ? "+" : "") + (100 * value).toFixed(2) + "%";
    return String(value);
  }

  function compare(a, b, numeric) {
    if (a === b) return 0;
    if (a === null || a === undefined) return 1; // missing values last either way
    if (b === null || b === undefined) return -1;
    if (numeric) return a - b;
    return String(a).localeCompare(String(b), "en", { numeric: true });
  }

  /* A table of `spec.rows` (arrays of raw values) with `spec.columns` ({label, type}); click a header to sort,
   * type in the filter to narrow, PAGE rows drawn at a time. `spec.id` names the <table>. */
  function sortableTable(parent, spec) {
    var cols = spec.columns, rows = spec.rows;
    var order = rows.map(function (_, i) { return i; });
    var view = order, shown = PAGE, sortCol = -1, sortDir = 1;
    var wrap = el("div", { class: "table-wrap" });
    if (spec.title) wrap.appendChild(el("h3", { text: spec.title }));
    var tools = el("div", { class: "table-tools" });
    var filter = null;
    if (rows.length > PAGE) {
      filter = el("input", { type: "search", placeholder: "filter rows (any column)", "aria-label": "filter rows" });
      tools.appendChild(filter);
    }
    var count = el("span");
    tools.appendChild(count);
    wrap.appendChild(tools);
    var table = el("table", { id: spec.id || null });
    var thead = el("thead"), tbody = el("tbody");
    var headRow = el("tr");
    var ths = cols.map(function (c, j) {
      var numeric = c.type !== "text";
      var th = el("th", { scope: "col", class: numeric ? "num" : null, "aria-sort": "none" });
      var b = el("button", { type: "button", text: c.label, title: "sort by " + c.label });
      b.addEventListener("click", function () {
        sortDir = sortCol === j ? -sortDir : numeric ? -1 : 1; // numbers: largest first on the first click
        sortCol = j;
        order.sort(function (x, y) { return sortDir * compare(rows[x][j], rows[y][j], numeric) || x - y; });
        ths.forEach(function (h, k) {
          h.setAttribute("aria-sort", k === j ? (sortDir > 0 ? "ascending" : "descending") : "none");
        });
        applyFilter();
      });
      th.appendChild(b);
      headRow.appendChild(th);
      return th;
    });
    thead.appendChild(headRow);
    table.appendChild(thead);
    table.appendChild(tbody);
    wrap.appendChild(table);
    if (spec.caption) wrap.appendChild(el("p", { class: "muted", text: spec.caption }));
    var more = el("button", { type: "button", class: "more", text: "show more rows" });
    more.addEventListener("click", function () { shown += 5 * PAGE; draw(); });
    wrap.appendChild(more);

    function applyFilter() {
      var q = filter ? filter.value.trim().toLowerCase() : "";
      view = !q ? order : order.filter(function (i) {
        return rows[i].some(function (v) { return v !== null && String(v).toLowerCase().indexOf(q) >= 0; });
      });
      draw();
    }

    function draw() {
      var frag = document.createDocumentFragment();
      var n = Math.min(shown, view.length);
      for (var k = 0; k < n; k++) {
        var r = rows[view[k]];
        var tr = document.createElement("tr");
        for (var j = 0; j < cols.length; j++) {
          var td = document.createElement("td");
          var type = cols[j].type;
          td.className = type === "text" ? (j === 0 ? "name" : "") : "num";
          td.textContent = cellText(r[j], type);
          if (type === "bytes" && r[j] !== null && Math.abs(r[j]) >= 1000) td.title = bothUnits(r[j]);
          tr.appendChild(td);
        }
        frag.appendChild(tr);
      }
      tbody.textContent = "";
      tbody.appendChild(frag);
      count.textContent = "showing " + fmtInt(n) + " of " + fmtInt(view.length) + " rows" +
        (view.length !== rows.length ? " (filtered from " + fmtInt(rows.length) + ")" : "");
      more.hidden = n >= view.length;
    }

    if (filter) filter.addEventListener("input", applyFilter);
    draw();
    parent.appendChild(wrap);
    return { table: table };
  }

  // --- summary --------------------------------------------------------------------------------------------

  function renderSummary(root, s) {
    var sec = section(root, "summary", s.single_instant ? "Total at one instant" : "Peak");
    var pk = s.peak;
    var strong = el("strong", { id: "peak-bytes", "data-bytes": String(pk.bytes), text: fmtInt(pk.bytes) + " bytes" });
    sec.appendChild(el("p", { class: "peak-line" }, [strong, " ", el("span", { class: "muted", text: "(" + bothUnits(pk.bytes) + ")" })]));
    sec.appendChild(el("p", { text: s.label }));
    var where = s.single_instant ? "evidence " + s.evidence + " on " + s.device
      : "evidence " + s.evidence + " on " + s.device + ", event " + fmtInt(pk.event) + " of " + fmtInt(s.num_events) +
        " (" + pk.phase + (pk.op ? ", op " + pk.op : "") + (pk.module ? ", module " + pk.module : "") + ")";
    sec.appendChild(el("p", { class: "muted", text: where }));
    var rows = CATS.filter(function (c) {
      return pk.by_category[c.name] || s.category_maxima[c.name];
    }).map(function (c) {
      var at = pk.by_category[c.name] || 0;
      return el("tr", null, [
        el("td", null, [swatch(c.color), c.name]),
        el("td", { class: "num", text: fmtInt(at), title: bothUnits(at) }),
        el("td", { class: "num", text: pk.bytes ? (100 * at / pk.bytes).toFixed(1) + "%" : "-" }),
        el("td", { class: "num", text: fmtInt(s.category_maxima[c.name] || 0) })
      ]);
    });
    var head = el("tr", null, ["category", "at the " + (s.single_instant ? "instant" : "peak") + " (bytes)", "share",
      "category's own maximum (bytes)"].map(function (t, i) {
      return el("th", { scope: "col", class: i ? "num" : null, text: t });
    }));
    var foot = el("tr", null, [el("th", { text: "total" }), el("th", { class: "num", text: fmtInt(pk.bytes) }),
      el("th", { class: "num", text: "100%" }), el("th", { class: "num", text: fmtInt(s.sum_of_category_maxima) })]);
    sec.appendChild(el("table", { id: "breakdown" }, [el("thead", null, head), el("tbody", null, rows), el("tfoot", null, foot)]));
    if (!s.single_instant) {
      var over = s.sum_of_category_maxima - pk.bytes;
      sec.appendChild(el("p", { class: "muted", text: "summing each category's maximum would claim " +
        fmtBytes(s.sum_of_category_maxima) + ": " + fmtInt(over) + " bytes more than was ever live at once " +
        "(the maxima do not coincide)" }));
    }
  }

  // --- the ledger: timeline, live set, entries ------------------------------------------------------------

  function prepareLedger(L) {
    var n = L.num_events, E = L.entries, m = E.bytes.length;
    var start = new Int32Array(m), stop = new Int32Array(m);
    var series = CATS.map(function () { return new Float64Array(n + 1); });
    for (var i = 0; i < m; i++) {
      start[i] = E.alloc[i] < 0 ? 0 : E.alloc[i];
      stop[i] = E.free[i] < 0 ? n : E.free[i];
      if (stop[i] > start[i]) {
        var d = series[E.category[i]];
        d[start[i]] += E.bytes[i];
        d[stop[i]] -= E.bytes[i];
      }
    }
    var totals = new Float64Array(n);
    series.forEach(function (d) {
      var run = 0;
      for (var e = 0; e < n; e++) { run += d[e]; d[e] = run; totals[e] += run; }
    });
    var peak = 0;
    for (var e = 1; e < n; e++) if (totals[e] > totals[peak]) peak = e;
    L.start = start; L.stop = stop; L.series = series; L.totals = totals; L.peak = peak;
    L.present = CATS.map(function (_, c) {
      for (var e = 0; e < n; e++) if (series[c][e]) return true;
      return false;
    });
    if (DATA.summary && totals[DATA.summary.peak.event] !== DATA.summary.peak.bytes) {
      errors.push("the timeline's total at the peak event (" + totals[DATA.summary.peak.event] +
        ") differs from the saved peak (" + DATA.summary.peak.bytes + ")");
    }
  }

  function str(L, i) { return L.strings[i]; }

  function lifetime(L, i) {
    var a = L.entries.alloc[i], f = L.entries.free[i];
    return (a < 0 ? "before" : String(a)) + "–" + (f < 0 ? "after" : String(f));
  }

  function liveAt(L, e) {
    var out = [], total = 0;
    for (var i = 0; i < L.start.length; i++) {
      if (L.start[i] <= e && e < L.stop[i]) { out.push(i); total += L.entries.bytes[i]; }
    }
    var B = L.entries.bytes, N = L.entries.name;
    out.sort(function (x, y) { return B[y] - B[x] || (N[x] < N[y] ? -1 : N[x] > N[y] ? 1 : 0); });
    return { indices: out, total: total };
  }

  /* Columns to draw: every event, or (when the clock is longer than the plot is wide) one column per pixel,
   * each drawn at the event of largest total inside it, so the peak is drawn exactly. */
  function drawColumns(L, cols) {
    var n = L.num_events, out = [];
    if (n <= cols) {
      for (var e = 0; e < n; e++) out.push({ ev: e, x0: e, x1: e + 1 });
      return out;
    }
    for (var b = 0; b < cols; b++) {
      var lo = Math.floor(b * n / cols), hi = Math.floor((b + 1) * n / cols);
      var best = lo;
      for (var i = lo + 1; i < hi; i++) if (L.totals[i] > L.totals[best]) best = i;
      out.push({ ev: best, x0: lo, x1: hi });
    }
    return out;
  }

  function renderTimeline(root, L, s) {
    var sec = section(root, "timeline", "Live memory over the step");
    sec.appendChild(el("p", { class: "muted", text: "Stacked live bytes by category at every event of the step's clock " +
      "(one event per op). Hover over the chart to see an instant; click to keep it; arrow keys move it when the chart has focus." }));
    var legend = el("div", { class: "legend", role: "list", "aria-label": "categories" });
    CATS.forEach(function (c, k) {
      if (L.present[k]) legend.appendChild(el("span", { role: "listitem" }, [swatch(c.color), c.name]));
    });
    sec.appendChild(legend);
    var holder = el("div");
    sec.appendChild(holder);
    var tools = el("div", { class: "tools" });
    var input = el("input", { type: "number", min: "0", max: String(L.num_events - 1), value: String(s.peak.event),
      "aria-label": "event to show" });
    var go = el("button", { type: "button", text: "show event" });
    var toPeak = el("button", { type: "button", text: "show the peak" });
    var pinned = el("span");
    tools.appendChild(el("label", null, ["event ", input]));
    tools.appendChild(go);
    tools.appendChild(toPeak);
    tools.appendChild(pinned);
    sec.appendChild(tools);
    var instant = el("div", { class: "instant" });
    var panel = el("div", { class: "panel", "aria-live": "polite" });
    var liveHolder = el("div");
    instant.appendChild(panel);
    instant.appendChild(liveHolder);
    sec.appendChild(instant);

    var state = { current: s.peak.event, pinned: false, pending: null, chart: null };

    function show(e) {
      e = Math.max(0, Math.min(L.num_events - 1, e | 0));
      state.current = e;
      if (state.chart) state.chart.moveCursor(e);
      input.value = String(e);
      renderInstant(panel, liveHolder, L, e, s);
    }

    function request(e) {
      if (state.pending !== null) { state.pending = e; return; }
      state.pending = e;
      window.requestAnimationFrame(function () { var x = state.pending; state.pending = null; show(x); });
    }

    function pin(on) {
      state.pinned = on;
      pinned.textContent = on ? "kept at event " + fmtInt(state.current) + " (click the chart to release)" : "";
    }

    function draw() {
      holder.textContent = "";
      state.chart = timelineChart(holder, L, s, {
        hover: function (e) { if (!state.pinned) request(e); },
        click: function (e) { if (state.pinned && e === state.current) { pin(false); } else { show(e); pin(true); } },
        key: function (delta) { show(state.current + delta); pin(true); }
      });
      state.chart.moveCursor(state.current);
    }

    go.addEventListener("click", function () { show(Number(input.value)); pin(true); });
    toPeak.addEventListener("click", function () { show(s.peak.event); pin(true); });
    draw();
    var asked = /^#event=(\d+)$/.exec(window.location.hash); // a link to one instant: page.html#event=281
    show(asked ? Number(asked[1]) : s.peak.event);
    if (asked) pin(true);
    var resizeTimer = null;
    window.addEventListener("resize", function () {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(draw, 150);
    });
  }

  function timelineChart(holder, L, s, on) {
    var W = Math.max(480, holder.clientWidth || 1200), H = 400;
    var M = { left: 86, right: 18, top: 30, bottom: 46 };
    var pw = W - M.left - M.right, ph = H - M.top - M.bottom;
    var n = L.num_events;
    var top = Math.max(s.peak.bytes, s.sum_of_category_maxima, 1) * 1.08;
    var unit = binaryUnit(top);
    var svg = svgEl("svg", { class: "chart", id: "timeline-chart", width: W, height: H, viewBox: "0 0 " + W + " " + H,
      role: "img", tabindex: "0",
      "aria-label": "live memory by category over " + n + " events; peak " + fmtBytes(s.peak.bytes) + " at event " + s.peak.event });
    function x(ev) { return M.left + pw * ev / n; }
    function y(bytes) { return M.top + ph - ph * bytes / top; }

    L.phases.forEach(function (run) {
      var x0 = x(run[1]), x1 = x(run[2]);
      svg.appendChild(svgEl("rect", { x: x0, y: M.top, width: Math.max(x1 - x0, 0.5), height: ph,
        fill: DATA.phase_colors[run[0]] || "#f3eef8" }, svgEl("title", { text: run[0] + ": events " + run[1] + "–" + (run[2] - 1) })));
      if (x1 - x0 > 56) svg.appendChild(svgEl("text", { x: (x0 + x1) / 2, y: M.top - 8, "text-anchor": "middle",
        class: "phase-label", text: run[0] }));
    });

    var ystep = niceStep(top / unit[0], 5);
    for (var v = 0; v <= top / unit[0] + 1e-9; v += ystep) {
      var yy = y(v * unit[0]);
      svg.appendChild(svgEl("line", { x1: M.left, x2: M.left + pw, y1: yy, y2: yy, class: "grid" }));
      svg.appendChild(svgEl("text", { x: M.left - 6, y: yy + 4, "text-anchor": "end", text: trimNum(v, ystep) }));
    }
    var xstep = Math.max(1, Math.round(niceStep(n, 8)));
    for (var t = 0; t <= n; t += xstep) {
      svg.appendChild(svgEl("line", { x1: x(t), x2: x(t), y1: M.top + ph, y2: M.top + ph + 4, class: "axis" }));
      svg.appendChild(svgEl("text", { x: x(t), y: M.top + ph + 16, "text-anchor": "middle", text: fmtInt(t) }));
    }
    svg.appendChild(svgEl("text", { x: M.left + pw / 2, y: H - 8, "text-anchor": "middle", class: "axis-label",
      text: "event (one per op on the step's clock)" }));
    svg.appendChild(svgEl("text", { x: 14, y: M.top + ph / 2, "text-anchor": "middle", class: "axis-label",
      transform: "rotate(-90 14 " + (M.top + ph / 2) + ")",
      text: "live memory (" + unit[1] + (unit[2] ? ", 1 " + unit[1] + " = 2^" + unit[2] + " bytes" : "") + ")" }));

    var cols = drawColumns(L, Math.floor(pw));
    var base = new Float64Array(cols.length);
    CATS.forEach(function (c, k) {
      if (!L.present[k]) return;
      var upper = [], lower = [];
      for (var i = 0; i < cols.length; i++) {
        var col = cols[i], b = base[i], tp = b + L.series[k][col.ev];
        upper.push("L" + x(col.x0).toFixed(1) + " " + y(tp).toFixed(1) + "H" + x(col.x1).toFixed(1));
        lower.push("L" + x(col.x1).toFixed(1) + " " + y(b).toFixed(1) + "H" + x(col.x0).toFixed(1));
        base[i] = tp;
      }
      var d = "M" + x(cols[0].x0).toFixed(1) + " " + y(0).toFixed(1) + upper.join("") + lower.reverse().join("") + "Z";
      svg.appendChild(svgEl("path", { d: d, fill: c.color, stroke: "none" },
        svgEl("title", { text: c.name })));
    });
    svg.appendChild(svgEl("line", { x1: M.left, x2: M.left + pw, y1: M.top + ph, y2: M.top + ph, class: "axis" }));
    svg.appendChild(svgEl("line", { x1: M.left, x2: M.left, y1: M.top, y2: M.top + ph, class: "axis" }));

    if (s.sum_of_category_maxima > s.peak.bytes) {
      var ys = y(s.sum_of_category_maxima);
      svg.appendChild(svgEl("line", { x1: M.left, x2: M.left + pw, y1: ys, y2: ys, stroke: "#57606a",
        "stroke-dasharray": "5 4" }));
      svg.appendChild(svgEl("text", { x: M.left + pw - 4, y: ys - 4, "text-anchor": "end", class: "axis-label",
        text: "sum of category maxima " + fmtInt(s.sum_of_category_maxima) + " (not simultaneous)" }));
    }

    var px = x(s.peak.event + 0.5), py = y(s.peak.bytes);
    svg.appendChild(svgEl("line", { x1: px, x2: px, y1: py, y2: M.top + ph, class: "peak-marker", "stroke-dasharray": "2 2" }));
    svg.appendChild(svgEl("path", { d: "M" + (px - 6) + " " + (py - 9) + "L" + (px + 6) + " " + (py - 9) + "L" + px + " " + py + "Z",
      fill: "#111" }));
    var right = px > M.left + pw / 2;
    svg.appendChild(svgEl("text", { id: "peak-label", x: right ? px - 10 : px + 10, y: Math.max(py - 12, M.top + 26),
      "text-anchor": right ? "end" : "start", class: "peak-text",
      text: "peak " + fmtBytes(s.peak.bytes) + " at event " + fmtInt(s.peak.event) + " (" + s.peak.phase + ")" }));

    var cursor = svgEl("line", { x1: 0, x2: 0, y1: M.top, y2: M.top + ph, class: "cursor" });
    svg.appendChild(cursor);
    var overlay = svgEl("rect", { x: M.left, y: M.top, width: pw, height: ph, fill: "transparent", style: "cursor:crosshair" });
    svg.appendChild(overlay);
    function eventAt(evt) {
      var r = svg.getBoundingClientRect();
      var sx = (evt.clientX - r.left) * W / r.width;
      return Math.max(0, Math.min(n - 1, Math.floor((sx - M.left) / pw * n)));
    }
    overlay.addEventListener("mousemove", function (evt) { on.hover(eventAt(evt)); });
    overlay.addEventListener("click", function (evt) { on.click(eventAt(evt)); });
    svg.addEventListener("keydown", function (evt) {
      var step = evt.shiftKey ? Math.max(1, Math.round(n / 100)) : 1;
      if (evt.key === "ArrowRight") { on.key(step); evt.preventDefault(); }
      if (evt.key === "ArrowLeft") { on.key(-step); evt.preventDefault(); }
    });
    holder.appendChild(svg);
    return {
      moveCursor: function (e) {
        var cx = x(e + 0.5);
        cursor.setAttribute("x1", cx);
        cursor.setAttribute("x2", cx);
      }
    };
  }

  function renderInstant(panel, liveHolder, L, e, s) {
    var ev = L.events;
    panel.textContent = "";
    var total = L.totals[e];
    panel.appendChild(el("p", null, [el("strong", { text: "event " + fmtInt(e) }), " of " + fmtInt(L.num_events) +
      (e === s.peak.event ? " — the peak" : "")]));
    panel.appendChild(el("p", { class: "muted", text: str(L, ev.phase[e]) + (str(L, ev.op[e]) ? ", op " + str(L, ev.op[e]) : "") +
      (str(L, ev.module[e]) ? ", module " + str(L, ev.module[e]) : "") }));
    panel.appendChild(el("p", { id: "instant-total", "data-bytes": String(total), text: "live " + fmtBytes(total) }));
    var rows = [];
    CATS.forEach(function (c, k) {
      var b = L.series[k][e];
      if (b) rows.push(el("tr", null, [el("td", null, [swatch(c.color), c.name]), el("td", { class: "num", text: fmtInt(b) }),
        el("td", { class: "num", text: total ? (100 * b / total).toFixed(1) + "%" : "-" })]));
    });
    panel.appendChild(el("table", null, el("tbody", null, rows)));
    var live = liveAt(L, e);
    liveHolder.textContent = "";
    var E = L.entries, cats = CATS;
    var tableRows = live.indices.map(function (i) {
      return [E.name[i], cats[E.category[i]].name, str(L, E.role[i]), str(L, E.dtype[i]), str(L, E.shape[i]),
        E.bytes[i], str(L, E.owner[i]), lifetime(L, i)];
    });
    sortableTable(liveHolder, {
      id: "live-table",
      title: fmtInt(live.indices.length) + " arrays live at event " + fmtInt(e) + ", largest first",
      columns: ENTRY_COLUMNS,
      rows: tableRows
    });
  }

  var ENTRY_COLUMNS = [{ label: "name", type: "text" }, { label: "category", type: "text" }, { label: "role", type: "text" },
    { label: "dtype", type: "text" }, { label: "shape", type: "text" }, { label: "bytes", type: "bytes" },
    { label: "module", type: "text" }, { label: "lifetime", type: "text" }];

  function renderEntries(root, L) {
    var sec = section(root, "entries", "Every array (" + fmtInt(L.entries.bytes.length) + ")");
    sec.appendChild(el("p", { class: "muted", text: "Lifetime on the event clock: allocated at the first event, freed at " +
      "the second; before: it existed before the step; after: it outlives the step. Click a header to sort." }));
    var E = L.entries;
    var rows = [];
    for (var i = 0; i < E.bytes.length; i++) {
      rows.push([E.name[i], CATS[E.category[i]].name, str(L, E.role[i]), str(L, E.dtype[i]), str(L, E.shape[i]),
        E.bytes[i], str(L, E.owner[i]), lifetime(L, i)]);
    }
    sortableTable(sec, { id: "entries-table", columns: ENTRY_COLUMNS, rows: rows });
  }

  // --- bars and the curve -----------------------------------------------------------------------------------

  function renderBars(root, spec, index) {
    var sec = section(root, "bars-" + index, spec.title);
    var items = spec.items;
    var max = Math.max.apply(null, items.map(function (it) { return it.bytes; }).concat([1]));
    var min = Math.min.apply(null, items.map(function (it) { return it.bytes; }));
    var W = Math.max(480, Math.min(sec.clientWidth || 1100, 1100)), rowH = 22;
    var M = { left: 210, right: 250, top: 6 };
    var H = M.top + rowH * items.length + 8;
    var svg = svgEl("svg", { class: "chart", width: W, height: H, viewBox: "0 0 " + W + " " + H, role: "img",
      "aria-label": spec.title });
    var pw = W - M.left - M.right;
    items.forEach(function (it, i) {
      var yy = M.top + i * rowH;
      var top = it.bytes === max;
      svg.appendChild(svgEl("text", { x: M.left - 8, y: yy + 15, "text-anchor": "end", text: it.label }));
      svg.appendChild(svgEl("rect", { x: M.left, y: yy + 3, width: Math.max(1, pw * it.bytes / max), height: rowH - 6,
        fill: top ? "#0b5cad" : "#8fb3d9" }, svgEl("title", { text: it.label + ": " + fmtBytes(it.bytes) })));
      svg.appendChild(svgEl("text", { x: M.left + pw * it.bytes / max + 6, y: yy + 15, text: fmtInt(it.bytes) +
        " (" + scaled(it.bytes, 1024, ["B", "KiB", "MiB", "GiB", "TiB"]) + ")" }));
    });
    sec.appendChild(svg);
    if (items.length > 1 && min > 0 && /rank/.test(spec.title)) {
      sec.appendChild(el("p", { class: "muted", text: "largest / smallest: " + (max / min).toFixed(4) }));
    }
  }

  var MARKERS = ["circle", "cross", "square", "diamond", "triangle"];
  // five markers against nine colours: the first 45 series differ in one or the other (the named baselines
  // follow the five methods of a sweep)
  var SERIES_COLORS = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#999999", "#882255"];

  function marker(kind, cx, cy, color) {
    var r = 5;
    if (kind === "circle") return svgEl("circle", { cx: cx, cy: cy, r: r, fill: color });
    if (kind === "square") return svgEl("rect", { x: cx - r, y: cy - r, width: 2 * r, height: 2 * r, fill: "none", stroke: color, "stroke-width": 2 });
    if (kind === "diamond") return svgEl("path", { d: "M" + cx + " " + (cy - r - 2) + "L" + (cx + r + 2) + " " + cy + "L" + cx + " " + (cy + r + 2) + "L" + (cx - r - 2) + " " + cy + "Z", fill: color });
    if (kind === "triangle") return svgEl("path", { d: "M" + cx + " " + (cy - r - 1) + "L" + (cx + r + 1) + " " + (cy + r) + "L" + (cx - r - 1) + " " + (cy + r) + "Z", fill: color });
    return svgEl("path", { d: "M" + (cx - r) + " " + (cy - r) + "L" + (cx + r) + " " + (cy + r) + "M" + (cx - r) + " " + (cy + r) + "L" + (cx + r) + " " + (cy - r), stroke: color, "stroke-width": 2 });
  }

  function renderPareto(root, P) {
    var sec = section(root, "pareto", P.title);
    var seconds = P.cost === "seconds";
    function flops(p) { return p.extra_flops + (p.extra_other_flops || 0); }  // as the solver counts them
    function xv(p) { return seconds ? p.extra_seconds * 1e3 : flops(p) / 1e6; }
    var all = [];
    P.series.forEach(function (s) { all = all.concat(s.points); });
    var xmax = Math.max.apply(null, all.map(xv).concat([1e-9])) * 1.08;
    var ys = all.map(function (p) { return p.peak_bytes; }).concat([P.plain_peak_bytes || 0, P.floor_bytes || 0]);
    var ymax = Math.max.apply(null, ys) * 1.04;
    var ymin = Math.min.apply(null, ys.filter(function (v) { return v > 0; })) * 0.96;
    var unit = binaryUnit(ymax);
    var W = Math.max(480, Math.min(sec.clientWidth || 900, 900)), H = 380;
    var M = { left: 80, right: 20, top: 16, bottom: 46 };
    var pw = W - M.left - M.right, ph = H - M.top - M.bottom;
    function x(v) { return M.left + pw * v / xmax; }
    function y(b) { return M.top + ph - ph * (b - ymin) / Math.max(ymax - ymin, 1); }
    var svg = svgEl("svg", { class: "chart", id: "pareto-chart", width: W, height: H, viewBox: "0 0 " + W + " " + H, role: "img",
      "aria-label": "peak against extra compute" });
    var ystep = niceStep((ymax - ymin) / unit[0], 5);
    for (var v = Math.ceil(ymin / unit[0] / ystep) * ystep; v <= ymax / unit[0]; v += ystep) {
      svg.appendChild(svgEl("line", { x1: M.left, x2: M.left + pw, y1: y(v * unit[0]), y2: y(v * unit[0]), class: "grid" }));
      svg.appendChild(svgEl("text", { x: M.left - 6, y: y(v * unit[0]) + 4, "text-anchor": "end", text: trimNum(v, ystep) }));
    }
    var xstep = niceStep(xmax, 6);
    for (var t = 0; t <= xmax; t += xstep) {
      svg.appendChild(svgEl("text", { x: x(t), y: M.top + ph + 16, "text-anchor": "middle", text: trimNum(t, xstep) }));
    }
    svg.appendChild(svgEl("line", { x1: M.left, x2: M.left + pw, y1: M.top + ph, y2: M.top + ph, class: "axis" }));
    svg.appendChild(svgEl("line", { x1: M.left, x2: M.left, y1: M.top, y2: M.top + ph, class: "axis" }));
    svg.appendChild(svgEl("text", { x: M.left + pw / 2, y: H - 8, "text-anchor": "middle", class: "axis-label",
      text: "extra compute in backward (" + (seconds ? "ms, measured" : "MFLOP") + ")" }));
    svg.appendChild(svgEl("text", { x: 14, y: M.top + ph / 2, "text-anchor": "middle", class: "axis-label",
      transform: "rotate(-90 14 " + (M.top + ph / 2) + ")", text: "peak (" + unit[1] + (unit[2] ? ", 2^" + unit[2] + " bytes" : "") + ")" }));
    [[P.plain_peak_bytes, "plain step's peak", "6 4"], [P.floor_bytes, "floor", "2 3"]].forEach(function (ref) {
      if (!ref[0]) return;
      svg.appendChild(svgEl("line", { x1: M.left, x2: M.left + pw, y1: y(ref[0]), y2: y(ref[0]), stroke: "#57606a", "stroke-dasharray": ref[2] }));
      svg.appendChild(svgEl("text", { x: M.left + pw - 4, y: y(ref[0]) - 4, "text-anchor": "end", class: "axis-label",
        text: ref[1] + " " + fmtInt(ref[0]) }));
    });
    var legend = el("div", { class: "legend" });
    P.series.forEach(function (s, k) {
      var color = SERIES_COLORS[k % SERIES_COLORS.length], kind = MARKERS[k % MARKERS.length];
      var pts = s.points.slice().sort(function (a, b) { return xv(a) - xv(b); });
      if (pts.length > 1 && k === 0) {
        svg.appendChild(svgEl("path", { d: pts.map(function (p, i) { return (i ? "L" : "M") + x(xv(p)) + " " + y(p.peak_bytes); }).join(""),
          fill: "none", stroke: color, "stroke-width": 1.5 }));
      }
      pts.forEach(function (p) {
        var g = marker(kind, x(xv(p)), y(p.peak_bytes), color);
        g.appendChild(svgEl("title", { text: s.name + ": peak " + fmtBytes(p.peak_bytes) + ", extra " +
          (seconds ? (p.extra_seconds * 1e3).toFixed(3) + " ms" : fmtInt(flops(p)) + " FLOPs") +
          "; recomputes " + (p.regions.length ? p.regions.join(", ") : "nothing") }));
        svg.appendChild(g);
      });
      var sw = svgEl("svg", { width: 14, height: 14, "aria-hidden": "true" }, marker(kind, 7, 7, color));
      legend.appendChild(el("span", null, [sw, " " + s.name]));
    });
    sec.appendChild(svg);
    sec.appendChild(legend);
  }

  // --- the page ---------------------------------------------------------------------------------------------

  function finish() {
    document.body.setAttribute("data-status", errors.length ? "error" : "ok");
    var box = document.getElementById("errors");
    box.textContent = errors.join("\n");
    box.hidden = !errors.length;
  }

  function main() {
    var root = document.getElementById("report");
    root.appendChild(el("h1", { text: DATA.title }));
    if (DATA.subtitle) root.appendChild(el("p", { class: "subtitle", text: "from " + DATA.subtitle }));
    if (DATA.summary) renderSummary(root, DATA.summary);
    if (DATA.facts.length) root.appendChild(el("ul", { class: "facts" }, DATA.facts.map(function (f) { return el("li", { text: f }); })));
    var L = DATA.ledger;
    if (L) {
      prepareLedger(L);
      var s = DATA.summary;
      if (L.num_events > 1) renderTimeline(root, L, s);
      renderEntries(root, L);
    }
    DATA.bars.forEach(function (b, i) { renderBars(root, b, i); });
    if (DATA.pareto) renderPareto(root, DATA.pareto);
    if (DATA.tables.length) {
      var sec = section(root, "tables", "Tables");
      DATA.tables.forEach(function (t, i) { t.id = "table-" + i; sortableTable(sec, t); });
    }
    var notes = DATA.notes.concat([DATA.units_note]);
    root.appendChild(el("div", { class: "notes" }, notes.map(function (n) { return el("p", { text: "note: " + n }); })));
  }

  var started = window.performance.now();
  try {
    main();
  } catch (e) {
    errors.push(String((e && e.stack) || e));
  }
  document.body.setAttribute("data-render-ms", String(Math.round(window.performance.now() - started)));
  finish();
})();
