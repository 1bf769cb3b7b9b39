// Sprout's dashboard (docs/dashboard.md): the sandboxes of this sproutd,
// read from its public API with the user's own key. Plain JavaScript, no
// build step. Everything the API says (ids, metadata, file names, error
// messages) is set as text (textContent, attributes), never parsed as HTML.
'use strict';

(() => {
  const KEY = 'sprout.apiKey';
  const POLL_MS = 2000;
  const HIDDEN_POLL_MS = 10000;
  const VMS = '/v1/runtime/vms';

  const $ = (sel) => document.querySelector(sel);

  /** An error answer of the API: its status, code and message. */
  class ApiError extends Error {
    constructor(status, code, message) {
      super(message);
      this.status = status;
      this.code = code;
    }
  }

  function describe(e) {
    if (e instanceof ApiError) {
      return e.status ? `${e.code} (${e.status}): ${e.message}` : `${e.code}: ${e.message}`;
    }
    return `error: ${e && e.message ? e.message : e}`;
  }

  /** Makes an element with text and attributes (never HTML). */
  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === 'class') e.className = v;
      else if (k === 'text') e.textContent = v;
      else e.setAttribute(k, v === true ? '' : String(v));
    }
    for (const k of kids) {
      if (k !== undefined && k !== null) e.append(k);
    }
    return e;
  }

  /** Sets `e`'s text only if it changed (no needless repaint). */
  function setText(e, text) {
    text = String(text);
    if (e.textContent !== text) e.textContent = text;
  }

  function show(e, on) {
    if (e.hidden === on) e.hidden = !on;
  }

  // ---- the API ----

  let keyWanted = false;

  async function request(method, path, body, raw) {
    const headers = { Accept: 'application/json' };
    const key = sessionStorage.getItem(KEY);
    if (key) headers.Authorization = `Bearer ${key}`;
    const init = { method, headers, cache: 'no-store' };
    if (body !== undefined) {
      headers['Content-Type'] = 'application/json';
      init.body = JSON.stringify(body);
    }
    let r;
    try {
      r = await fetch(path, init);
    } catch (e) {
      throw new ApiError(0, 'unreachable', `sproutd did not answer (${e.message})`);
    }
    if (!r.ok) {
      let code = `http_${r.status}`;
      let message = r.statusText || 'error';
      try {
        const v = await r.json();
        if (v && v.error) {
          code = String(v.error.code);
          message = String(v.error.message);
        }
      } catch (_) {
        // Not the envelope: the status says it.
      }
      const err = new ApiError(r.status, code, message);
      if (r.status === 401) askForKey(err);
      throw err;
    }
    if (raw) return r;
    return r.json();
  }

  function askForKey(err) {
    keyWanted = true;
    const had = sessionStorage.getItem(KEY);
    setText($('#auth-message'), had
      ? `The key given was refused: ${describe(err)}`
      : `This sproutd asks for an API key: ${describe(err)}`);
    if ($('#auth').hidden) {
      show($('#auth'), true);
      $('#api-key').focus();
    }
  }

  function keyGiven(key) {
    sessionStorage.setItem(KEY, key);
    keyWanted = false;
    show($('#auth'), false);
    $('#api-key').value = '';
    showKeyButton();
    loadInfo();
    tick();
  }

  function showKeyButton() {
    show($('#forget-key'), sessionStorage.getItem(KEY) !== null);
  }

  // ---- page-wide errors and the live indicator ----

  function showError(e) {
    if (e instanceof ApiError && e.status === 401) {
      // The key form says it.
      show($('#error'), false);
      return;
    }
    setText($('#error'), describe(e));
    show($('#error'), true);
  }

  function clearError() {
    show($('#error'), false);
  }

  function stamp(ok) {
    const t = new Date().toLocaleTimeString();
    setText($('#live'), ok ? `Live · updated ${t}` : `Not updated since ${lastOk || 'loading'}`);
    $('#live').classList.toggle('stale', !ok);
    if (ok) lastOk = t;
  }
  let lastOk = '';

  // ---- formatting ----

  const short = (id) => String(id).slice(0, 8);

  function age(iso) {
    const t = Date.parse(iso);
    if (Number.isNaN(t)) return '?';
    const s = Math.max(0, Math.floor((Date.now() - t) / 1000));
    if (s < 60) return `${s} s`;
    const m = Math.floor(s / 60);
    if (m < 60) return `${m} min`;
    const h = Math.floor(m / 60);
    if (h < 48) return `${h} h ${m % 60} min`;
    return `${Math.floor(h / 24)} d`;
  }

  function bytes(n) {
    if (typeof n !== 'number') return '';
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) {
      n /= 1024;
      i += 1;
    }
    return i === 0 ? `${n} B` : `${n.toFixed(n < 10 ? 1 : 0)} ${units[i]}`;
  }

  const shape = (vm) => `${vm.cpus} vCPU${vm.cpus === 1 ? '' : 's'} · ${vm.memoryMb} MiB`;

  const vmHref = (id) => `/dashboard/vms/${encodeURIComponent(id)}`;

  function stateBadge(e, state, reason) {
    state = String(state);
    setText(e, state);
    if (e.dataset.state !== state) {
      e.dataset.state = state;
      e.className = `state state-${state.replace(/[^a-z]/g, '')}`;
    }
    if (reason) e.title = reason;
    else e.removeAttribute('title');
  }

  function vmLink(id, text) {
    return el('a', { href: vmHref(id), class: 'vm-link mono', title: id, text: text || short(id) });
  }

  // ---- polling ----

  let view = null;
  let busy = false;
  let again = false;
  let timer = 0;

  /** Refreshes the view now (or right after the refresh under way). */
  async function tick() {
    if (keyWanted) return; // until the key form is filled in
    if (busy) {
      again = true;
      return;
    }
    busy = true;
    clearTimeout(timer);
    try {
      await view.refresh();
      clearError();
      stamp(true);
    } catch (e) {
      showError(e);
      stamp(false);
    } finally {
      busy = false;
      if (again) {
        again = false;
        tick();
      } else {
        timer = setTimeout(tick, document.hidden ? HIDDEN_POLL_MS : POLL_MS);
      }
    }
  }

  async function loadInfo() {
    try {
      const info = await request('GET', '/v1/info');
      const parts = [`sproutd ${info.version}`];
      if (info.tenant && info.tenant.name) parts.push(`tenant ${info.tenant.name}`);
      if (info.tenant && info.tenant.slots !== null && info.tenant.slots !== undefined) {
        parts.push(`${info.tenant.slotsInUse} of ${info.tenant.slots} slots`);
      }
      const hm = info.hostMode || {};
      if (hm.lab) parts.push('emulated lab');
      else if (!hm.linuxGuests) parts.push('test guest only');
      setText($('#host'), parts.join(' · '));
      $('#host').title = hm.note || hm.reason || '';
    } catch (_) {
      // The views say what is wrong.
    }
  }

  // ---- the list ----

  function listView() {
    const tbody = $('#vms tbody');
    const rows = new Map();

    function makeRow(id) {
      const cells = {
        link: vmLink(id),
        host: el('span', { class: 'muted small' }),
        state: el('span', { class: 'state' }),
        image: el('td'),
        shape: el('td'),
        age: el('td'),
        meta: el('td', { class: 'meta' }),
        parent: el('td'),
      };
      const tr = el('tr', { 'data-vm-id': id },
        el('td', {}, cells.link, ' ', cells.host),
        el('td', { 'data-field': 'state' }, cells.state),
        cells.image, cells.shape, cells.age, cells.meta, cells.parent);
      return { tr, cells, meta: null, parent: null, text: '' };
    }

    function update(row, vm) {
      const c = row.cells;
      setText(c.host, vm.hostname || '');
      stateBadge(c.state, vm.state, vm.failureReason);
      setText(c.image, vm.image);
      setText(c.shape, shape(vm));
      setText(c.age, age(vm.createdAt));
      c.age.title = vm.createdAt;
      const meta = JSON.stringify(vm.metadata || {});
      if (row.meta !== meta) {
        row.meta = meta;
        c.meta.replaceChildren(...Object.entries(vm.metadata || {}).map(
          ([k, v]) => el('span', { class: 'chip', title: `${k}=${v}` }, el('b', { text: k }), `=${v}`)));
      }
      const parent = vm.parentVmId || '';
      if (row.parent !== parent) {
        row.parent = parent;
        c.parent.replaceChildren(parent ? vmLink(parent) : el('span', { class: 'muted', text: '—' }));
      }
      row.text = [vm.vmId, vm.state, vm.image, vm.hostname || '', parent,
        ...Object.entries(vm.metadata || {}).map(([k, v]) => `${k}=${v}`)].join('\n').toLowerCase();
      row.vm = vm;
    }

    function matches(row, terms) {
      return terms.every((t) => {
        const eq = t.indexOf('=');
        if (eq > 0) {
          const k = t.slice(0, eq);
          const v = t.slice(eq + 1);
          return Object.entries(row.vm.metadata || {}).some(
            ([mk, mv]) => mk.toLowerCase() === k && mv.toLowerCase().includes(v));
        }
        return row.text.includes(t);
      });
    }

    function filter() {
      const terms = $('#filter').value.toLowerCase().split(/\s+/).filter(Boolean);
      let shown = 0;
      for (const row of rows.values()) {
        const on = matches(row, terms);
        show(row.tr, on);
        if (on) shown += 1;
      }
      const n = rows.size;
      setText($('#count'), shown === n
        ? `${n} sandbox${n === 1 ? '' : 'es'}`
        : `${shown} of ${n} shown`);
    }

    function render(vms) {
      const seen = new Set();
      let prev = null;
      for (const vm of vms) {
        seen.add(vm.vmId);
        let row = rows.get(vm.vmId);
        if (!row) {
          row = makeRow(vm.vmId);
          rows.set(vm.vmId, row);
        }
        update(row, vm);
        const want = prev ? prev.nextSibling : tbody.firstChild;
        if (want !== row.tr) tbody.insertBefore(row.tr, want);
        prev = row.tr;
      }
      for (const [id, row] of rows) {
        if (!seen.has(id)) {
          row.tr.remove();
          rows.delete(id);
        }
      }
      show($('#empty'), vms.length === 0);
      show($('#vms'), vms.length > 0);
      filter();
    }

    $('#filter').addEventListener('input', filter);
    document.title = 'Sprout · sandboxes';
    show($('#list-view'), true);

    return {
      async refresh() {
        const v = await request('GET', VMS);
        render(v.vms || []);
      },
    };
  }

  // ---- one sandbox ----

  const ALLOWED = {
    pause: ['running'],
    resume: ['paused'],
    fork: ['running', 'paused'],
    snapshot: ['running', 'paused'],
    delete: ['running', 'paused', 'sleeping', 'hibernated', 'failed', 'archived'],
  };
  const DOING = {
    pause: 'Pausing', resume: 'Resuming', fork: 'Forking', snapshot: 'Snapshotting', delete: 'Deleting',
  };

  /** Why a sandbox in `state` cannot serve process and file calls now (none: it can). */
  function notServing(state) {
    switch (state) {
      case 'running': return null;
      case 'paused': return 'The sandbox is paused: it answers no process or file call until it is resumed.';
      case 'sleeping': return 'The sandbox is asleep: reading this would wake it. Refresh reads it anyway (and wakes it).';
      case 'hibernated': return 'The sandbox is hibernated: only a wake brings it back.';
      default: return `Not read while the sandbox is ${state}.`;
    }
  }

  function vmView(id) {
    const base = `${VMS}/${encodeURIComponent(id)}`;
    let vm = null;
    let gone = false;
    let acting = null;
    let armed = 0;
    let servedState = null;
    let filesPath = '.';

    const facts = {};
    for (const [k, label] of [
      ['vmId', 'Id'], ['image', 'Image'], ['shape', 'Shape'], ['created', 'Created'],
      ['hostname', 'Host name'], ['workerPid', 'Worker pid'], ['idle', 'Idle timeout'],
      ['internet', 'Internet'], ['failure', 'Failure'],
    ]) {
      const dd = el('dd', { id: `fact-${k}` });
      facts[k] = dd;
      $('#facts').append(el('dt', { text: label }), dd);
    }

    setText($('#crumb-id'), id);
    setText($('#vm-title'), `Sandbox ${short(id)}`);
    $('#vm-title').title = id;
    document.title = `Sprout · ${short(id)}`;
    show($('#vm-view'), true);

    // -- actions --

    function buttons() {
      for (const b of document.querySelectorAll('[data-action]')) {
        const a = b.dataset.action;
        const state = vm && !gone ? vm.state : null;
        const ok = state !== null && ALLOWED[a].includes(state) && acting === null;
        b.disabled = !ok;
        if (state === null) b.title = gone ? 'The sandbox is gone' : '';
        else if (!ALLOWED[a].includes(state)) b.title = `Not possible while ${state}`;
        else b.removeAttribute('title');
      }
      $('#fork-count').disabled = !(vm && !gone && ALLOWED.fork.includes(vm.state));
    }

    function status(text, kind) {
      const s = $('#action-status');
      setText(s, text);
      s.dataset.result = kind || '';
    }

    function disarm() {
      armed = 0;
      const b = $('[data-action="delete"]');
      setText(b, 'Delete');
      b.classList.remove('armed');
    }

    async function act(action) {
      if (action === 'delete' && !armed) {
        const b = $('[data-action="delete"]');
        setText(b, 'Delete: sure?');
        b.classList.add('armed');
        armed = setTimeout(disarm, 4000);
        return;
      }
      let count = 1;
      if (action === 'fork') {
        count = Number($('#fork-count').value);
        if (!Number.isInteger(count) || count < 1 || count > 100) {
          status('Fork: the count must be 1 to 100', 'error');
          return;
        }
      }
      if (armed) {
        clearTimeout(armed);
        disarm();
      }
      acting = action;
      buttons();
      status(`${DOING[action]}…`, 'busy');
      try {
        if (action === 'pause' || action === 'resume') {
          vm = await request('POST', `${base}/${action}`);
          status(action === 'pause' ? 'Paused' : 'Resumed', 'ok');
          render();
        } else if (action === 'snapshot') {
          const r = await request('POST', `${base}/snapshot`, {});
          status(`Snapshot ${short(r.snapshotId)} taken`, 'ok');
        } else if (action === 'fork') {
          const r = await request('POST', `${base}/fork`, { count });
          const bad = r.forks.filter((f) => f.error);
          const good = r.forks.length - bad.length;
          if (bad.length) {
            status(`Forked ${good} of ${r.forks.length}; ${bad.map((f) => `${short(f.vmId)}: ${f.error}`).join('; ')}`, 'error');
          } else {
            status(`Forked ${good}: ${r.forks.map((f) => short(f.vmId)).join(', ')}`, 'ok');
          }
        } else if (action === 'delete') {
          await request('DELETE', base);
          status('Deleted', 'ok');
          gone = true;
          location.assign('/dashboard');
          return;
        }
      } catch (e) {
        status(`${DOING[action]} failed: ${describe(e)}`, 'error');
      } finally {
        acting = null;
        buttons();
      }
      tick();
    }

    for (const b of document.querySelectorAll('[data-action]')) {
      b.addEventListener('click', () => act(b.dataset.action));
    }

    // -- the sandbox's facts and lineage --

    let metaSig = null;
    let childSig = null;
    let snapSig = null;
    let parentSig = null;

    function render() {
      stateBadge($('#state'), vm.state, vm.failureReason);
      setText(facts.vmId, vm.vmId);
      setText(facts.image, vm.runtime === 'vm' ? `${vm.image} (runtime vm: its own systemd)` : vm.image);
      setText(facts.shape, shape(vm));
      setText(facts.created, `${age(vm.createdAt)} ago (${vm.createdAt})`);
      setText(facts.hostname, vm.hostname || '—');
      setText(facts.workerPid, vm.workerPid === null ? '— (no worker)' : vm.workerPid);
      setText(facts.idle, vm.idleTimeoutSecs === null ? 'never sleeps by itself' : `${vm.idleTimeoutSecs} s`);
      setText(facts.internet, vm.disableInternet ? 'disabled' : 'allowed');
      setText(facts.failure, vm.failureReason || '—');
      const meta = JSON.stringify(vm.metadata || {});
      if (meta !== metaSig) {
        metaSig = meta;
        const entries = Object.entries(vm.metadata || {});
        $('#metadata tbody').replaceChildren(...entries.map(
          ([k, v]) => el('tr', {}, el('th', { class: 'mono', text: k }), el('td', { text: v }))));
        show($('#metadata'), entries.length > 0);
        show($('#metadata-empty'), entries.length === 0);
      }
      const src = vm.snapshotId
        ? el('span', { class: 'mono', title: vm.snapshotId, text: `snapshot ${short(vm.snapshotId)}` })
        : el('span', { class: 'muted', text: `a boot of the image ${vm.image}` });
      if ($('#lineage-source').dataset.sig !== (vm.snapshotId || '')) {
        $('#lineage-source').dataset.sig = vm.snapshotId || '';
        $('#lineage-source').replaceChildren(src);
      }
      buttons();
    }

    function renderLineage(all, snaps) {
      const byId = new Map(all.map((v) => [v.vmId, v]));
      const p = vm.parentVmId;
      const pSig = p ? `${p}:${byId.has(p) ? byId.get(p).state : 'gone'}` : '';
      if (pSig !== parentSig) {
        parentSig = pSig;
        const dd = $('#lineage-parent');
        if (!p) dd.replaceChildren(el('span', { class: 'muted', text: 'none (not a fork)' }));
        else if (byId.has(p)) {
          const s = el('span', { class: 'state' });
          stateBadge(s, byId.get(p).state);
          dd.replaceChildren(vmLink(p, p), ' ', s);
        } else dd.replaceChildren(el('span', { class: 'mono', text: p }), el('span', { class: 'muted', text: ' (deleted)' }));
      }
      const kids = all.filter((v) => v.parentVmId === vm.vmId);
      const cSig = JSON.stringify(kids.map((k) => [k.vmId, k.state]));
      if (cSig !== childSig) {
        childSig = cSig;
        $('#children').replaceChildren(...kids.map((k) => {
          const s = el('span', { class: 'state' });
          stateBadge(s, k.state, k.failureReason);
          return el('li', { 'data-vm-id': k.vmId }, vmLink(k.vmId, k.vmId), ' ', s,
            el('span', { class: 'muted small', text: ` ${shape(k)}` }));
        }));
        setText($('#children-count'), kids.length ? `(${kids.length})` : '');
        show($('#children-empty'), kids.length === 0);
      }
      const mine = snaps.filter((s) => s.vmId === vm.vmId);
      const sSig = JSON.stringify(mine.map((s) => [s.snapshotId, s.durable, age(s.createdAt)]));
      if (sSig !== snapSig) {
        snapSig = sSig;
        $('#snapshots tbody').replaceChildren(...mine.map((s) => el('tr', { 'data-snapshot-id': s.snapshotId },
          el('td', { class: 'mono', title: s.snapshotId, text: short(s.snapshotId) }),
          el('td', { text: s.kind }),
          el('td', { text: s.name || '' }),
          el('td', { title: s.createdAt, text: age(s.createdAt) }),
          el('td', { text: bytes(s.sizeBytes) }),
          el('td', { text: s.durable ? 'yes' : 'no' }))));
        show($('#snapshots'), mine.length > 0);
        show($('#snapshots-empty'), mine.length === 0);
      }
    }

    // -- processes and files: read on demand (a read wakes a sleeping
    // sandbox and keeps one from going idle, so they are not polled) --

    function sectionError(name, e) {
      setText($(`#${name}-error`), describe(e));
      show($(`#${name}-error`), true);
    }

    function sectionNote(name, text) {
      setText($(`#${name}-note`), text || '');
      show($(`#${name}-note`), Boolean(text));
    }

    async function loadProcesses() {
      sectionNote('processes', null);
      try {
        const v = await request('GET', `${base}/processes`);
        show($('#processes-error'), false);
        const ps = v.processes || [];
        $('#process-table tbody').replaceChildren(...ps.map((p) => {
          let st = 'running';
          if (!p.running && p.exit) {
            st = p.exit.signal ? `killed by ${p.exit.signal}` : `exited ${p.exit.exitCode}`;
            if (p.exit.timedOut) st += ' (timed out)';
          } else if (!p.running) st = 'exited';
          return el('tr', { 'data-exec-id': p.execId },
            el('td', { text: p.execId }), el('td', { text: p.pid }),
            el('td', { class: 'mono', text: p.command }), el('td', { text: st }),
            el('td', { title: p.startedAt, text: age(p.startedAt) }));
        }));
        show($('#process-table'), ps.length > 0);
        show($('#processes-empty'), ps.length === 0);
      } catch (e) {
        show($('#process-table'), false);
        show($('#processes-empty'), false);
        sectionError('processes', e);
      }
    }

    function childPath(name) {
      return filesPath === '.' ? name : `${filesPath}/${name}`;
    }

    function renderCrumbs() {
      const nav = $('#files-path');
      const parts = filesPath === '.' ? [] : filesPath.split('/');
      const items = [el('button', { type: 'button', class: 'link', 'data-path': '.', text: '/workspace' })];
      parts.forEach((p, i) => {
        items.push(el('span', { class: 'muted', text: ' / ' }));
        items.push(el('button', { type: 'button', class: 'link', 'data-path': parts.slice(0, i + 1).join('/'), text: p }));
      });
      nav.replaceChildren(...items);
    }

    async function loadFiles(path) {
      if (path !== undefined) filesPath = path;
      renderCrumbs();
      sectionNote('files', null);
      try {
        const v = await request('GET', `${base}/files?path=${encodeURIComponent(filesPath)}`);
        show($('#files-error'), false);
        const entries = (v.entries || []).slice().sort((a, b) => {
          const da = a.type === 'dir' ? 0 : 1;
          const db = b.type === 'dir' ? 0 : 1;
          return da - db || (a.name < b.name ? -1 : a.name > b.name ? 1 : 0);
        });
        $('#file-table tbody').replaceChildren(...entries.map((f) => {
          const p = childPath(f.name);
          const name = f.type === 'dir'
            ? el('button', { type: 'button', class: 'link', 'data-path': p, text: `${f.name}/` })
            : el('span', { text: f.name });
          const dl = f.type === 'file' || f.type === 'symlink'
            ? el('button', { type: 'button', class: 'quiet', 'data-download': p, 'data-name': f.name, text: 'Download' })
            : null;
          return el('tr', { 'data-file': f.name },
            el('td', { class: 'mono' }, name), el('td', { text: f.type }),
            el('td', { text: f.type === 'dir' ? '' : bytes(f.size) }), el('td', {}, dl));
        }));
        show($('#file-table'), entries.length > 0);
        show($('#files-empty'), entries.length === 0);
        if (v.truncated) sectionNote('files', 'Only the first 10000 entries are shown.');
      } catch (e) {
        show($('#file-table'), false);
        show($('#files-empty'), false);
        sectionError('files', e);
      }
    }

    async function download(btn) {
      btn.disabled = true;
      const label = btn.textContent;
      setText(btn, 'Downloading…');
      try {
        // Fetched with the key (a plain link could not carry it), then saved.
        const r = await request('GET', `${base}/files/raw?path=${encodeURIComponent(btn.dataset.download)}`, undefined, true);
        const url = URL.createObjectURL(await r.blob());
        const a = el('a', { href: url, download: btn.dataset.name, hidden: true });
        document.body.append(a);
        a.click();
        a.remove();
        setTimeout(() => URL.revokeObjectURL(url), 60000);
      } catch (e) {
        sectionError('files', e);
      } finally {
        btn.disabled = false;
        setText(btn, label);
      }
    }

    $('#files').addEventListener('click', (ev) => {
      const t = ev.target.closest('button');
      if (!t) return;
      if (t.dataset.download) download(t);
      else if (t.dataset.path) loadFiles(t.dataset.path);
    });
    $('#processes-refresh').addEventListener('click', () => loadProcesses());
    $('#files-refresh').addEventListener('click', () => loadFiles());

    /** Reads processes and files once the sandbox can serve them (when
     * the page opens on it, or it comes back to running). */
    function serveSections() {
      if (vm.state === servedState) return;
      servedState = vm.state;
      const why = notServing(vm.state);
      if (why) {
        for (const s of ['processes', 'files']) {
          show($(`#${s}-error`), false);
          sectionNote(s, why);
        }
        for (const t of ['#process-table', '#processes-empty', '#file-table', '#files-empty']) {
          show($(t), false);
        }
        if (filesPath === '.') renderCrumbs();
        return;
      }
      loadProcesses();
      loadFiles();
    }

    return {
      async refresh() {
        try {
          vm = await request('GET', base);
          gone = false;
        } catch (e) {
          if (e instanceof ApiError && e.code === 'vm_not_found') {
            gone = true;
            stateBadge($('#state'), 'gone');
            buttons();
          }
          throw e;
        }
        render();
        serveSections();
        const [list, snaps] = await Promise.all([
          request('GET', VMS),
          request('GET', '/v1/runtime/snapshots'),
        ]);
        renderLineage(list.vms || [], snaps.snapshots || []);
      },
    };
  }

  // ---- start ----

  function start() {
    $('#auth-form').addEventListener('submit', (ev) => {
      ev.preventDefault();
      const k = $('#api-key').value.trim();
      if (k) keyGiven(k);
    });
    $('#forget-key').addEventListener('click', () => {
      sessionStorage.removeItem(KEY);
      showKeyButton();
      tick();
    });
    document.addEventListener('visibilitychange', () => {
      if (!document.hidden) tick();
    });
    showKeyButton();
    const path = location.pathname.replace(/\/+$/, '');
    const m = path.match(/^\/dashboard\/vms\/([^/]+)$/);
    let id = null;
    if (m) {
      try {
        id = decodeURIComponent(m[1]);
      } catch (_) {
        id = m[1];
      }
    }
    if (path === '/dashboard') view = listView();
    else if (id !== null) view = vmView(id);
    else {
      show($('#nowhere'), true);
      setText($('#live'), '');
      return;
    }
    loadInfo();
    tick();
  }

  start();
})();
