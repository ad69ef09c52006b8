/**
 * The left-sidebar panel: engine picker, start/stop, model/device/uptime, live numbers, a control
 * for every setting that can change without a restart (built from the server's settings schema,
 * validated by the engine) and a compact live timeline.
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { EngineConnection, ISettingSchema, WorkbenchAPI, WorkbenchError } from './api';
import { el } from './dom';
import { expertHeatmap, formatUptime, IChange, liveNumbers } from './model';
import { TimelineView } from './timeline';

const KIND_TITLES: Record<string, string> = {
  headline: 'Serving ideas',
  live: 'Live settings (next step)',
  relayout: 'Re-layout (no restart)',
  reload: 'Reload (no restart)',
  restart: 'Fixed at start (restart to change)',
  'read-only': 'Remote server (read-only)'
};

const NUMBERS: Array<[Exclude<keyof ReturnType<typeof liveNumbers>, 'kvBlocks' | 'stepParts'>, string, string]> = [
  ['tokS', 'tok/s', 'output tokens per second (last 10 s)'],
  ['queue', 'queue', 'requests waiting'],
  ['running', 'running', 'requests in the batch'],
  ['kv', 'KV use', 'KV cache blocks in use'],
  ['hitRate', 'prefix hit', 'prompt tokens served from the prefix cache'],
  ['acceptance', 'spec accept', 'speculative tokens accepted'],
  ['ttft', 'TTFT ms', 'time to first token (ms), median of recent requests'],
  ['itl', 'ITL ms', 'inter-token latency (ms), median of recent requests'],
  ['cpu', 'CPU cores', "CPU the engine process uses, in cores' worth (the host plot is in the main-area timeline)"],
  ['memory', 'memory GiB', 'resident memory of the engine process'],
  ['limit', 'step time', 'the part of an engine step that took most of the last 10 s of steps']
];


/** The info table's kernels row: the kernel variant, the large steps' compute path and, on our
 * attention backends, the prefill path (the dashboard's kernels line says the same, with why). */
export function kernelsText(status: Record<string, any>): string {
  const prefill = status.prefill_attention ? ` · prefill ${status.prefill_attention}` : '';
  return `${status.kernel_variant} · large steps ${status.compute_path}${prefill}`;
}

/** Turn a control's value into the setting's type (the engine still validates it). */
export function controlValue(spec: ISettingSchema, input: HTMLInputElement | HTMLSelectElement): any {
  if (spec.type === 'bool') {
    return (input as HTMLInputElement).checked;
  }
  const raw = input.value;
  if (spec.allow_none && (raw === '' || raw === '__none__')) {
    return null;
  }
  if (spec.type === 'int') {
    return raw.trim() === '' ? raw : Number(raw);
  }
  if (spec.type === 'enum' && spec.values) {
    const hit = spec.values.find(v => String(v) === raw);
    return hit === undefined ? raw : hit;
  }
  return raw;
}

export class WorkbenchPanel extends Widget {
  constructor(
    readonly api: WorkbenchAPI,
    readonly openTimeline: (engine: string | null) => void,
    readonly openRuns: () => void = () => undefined
  ) {
    super();
    this.id = 'serving-workbench-panel';
    this.addClass('wb-Panel');
    this.title.caption = 'Serving Workbench';
    this._build();
    void this.refresh();
    this._poll = setInterval(() => {
      if (this.isVisible) {
        void this.refresh(true);
      }
      this._tickUptime();
    }, 3000);
  }

  private _engine: string | null = null;
  private _conn: EngineConnection | null = null;
  private _schema: ISettingSchema[] = [];
  /** `refused`: the setting's value when the engine refused a change (its error stays until the value moves on). */
  private _controls = new Map<
    string,
    { spec: ISettingSchema; input: HTMLInputElement | HTMLSelectElement; error: HTMLElement; refused?: any }
  >();
  private _poll: any;
  private _uptimeBase: { value: number; at: number } | null = null;
  private _uptimeShown: number | null = null;
  private _picker!: HTMLSelectElement;
  private _message!: HTMLElement;
  private _notice: string | null = null; // said once the selected engine is live (after Start)
  private _routes!: HTMLElement;
  private _info!: HTMLElement;
  private _numbers = new Map<string, HTMLElement>();
  private _experts!: HTMLElement;
  /** Whether an engine is attached and ready: controls only work then. */
  private _live = false;
  private _settingsBox!: HTMLElement;
  private _timeline!: TimelineView;
  private _stopButton!: HTMLButtonElement;
  private _startName!: HTMLInputElement;
  private _startModel!: HTMLInputElement;
  private _startButton!: HTMLButtonElement;
  private _clusterRow!: HTMLElement;
  private _replicaPicker!: HTMLSelectElement;
  private _routerPicker!: HTMLSelectElement;

  get engine(): string | null {
    return this._engine;
  }

  get timeline(): TimelineView {
    return this._timeline;
  }

  private _build(): void {
    const root = this.node;
    root.appendChild(el('h2', 'wb-Panel-title', 'Serving Workbench'));

    const pickRow = el('div', 'wb-Row');
    this._picker = el('select', 'wb-EnginePicker jp-mod-styled');
    this._picker.title = 'running engines';
    this._picker.onchange = () => this.selectEngine(this._picker.value || null);
    const refresh = el('button', 'wb-Button wb-Refresh jp-mod-styled', '↻');
    refresh.title = 'refresh the engine list';
    refresh.onclick = () => void this.refresh();
    this._stopButton = el('button', 'wb-Button wb-StopButton jp-mod-styled jp-mod-warn', 'Stop');
    this._stopButton.title = 'stop this engine';
    this._stopButton.onclick = () => void this._stop();
    pickRow.append(this._picker, refresh, this._stopButton);
    root.appendChild(pickRow);

    const startRow = el('div', 'wb-Row wb-StartRow');
    this._startName = el('input', 'wb-StartName jp-mod-styled');
    this._startName.placeholder = 'name';
    this._startModel = el('input', 'wb-StartModel jp-mod-styled');
    this._startModel.placeholder = 'model (empty: embedded default)';
    this._startButton = el('button', 'wb-Button wb-StartButton jp-mod-styled jp-mod-accept', 'Start');
    this._startButton.onclick = () => void this._start();
    startRow.append(this._startName, this._startModel, this._startButton);
    root.appendChild(startRow);

    // Clusters only: which replica a settings change goes to (all, one at a time, by default)
    // and the routing policy, switched live.
    this._clusterRow = el('div', 'wb-Row wb-ClusterRow');
    this._clusterRow.hidden = true;
    this._replicaPicker = el('select', 'wb-ReplicaPicker jp-mod-styled');
    this._replicaPicker.title = 'settings changes go to this replica (all: one replica at a time)';
    this._routerPicker = el('select', 'wb-RouterPicker jp-mod-styled');
    this._routerPicker.title = 'how new requests are routed to replicas';
    this._routerPicker.onchange = () => void this._setRouter(this._routerPicker.value);
    this._clusterRow.append(this._replicaPicker, this._routerPicker);
    root.appendChild(this._clusterRow);

    this._message = el('div', 'wb-Message');
    root.appendChild(this._message);

    // Routers only (workbench.routing): each member's share of the answered requests, live
    this._routes = el('div', 'wb-Routes');
    this._routes.hidden = true;
    root.appendChild(this._routes);

    this._info = el('div', 'wb-Info');
    root.appendChild(this._info);

    const numbers = el('div', 'wb-Numbers');
    for (const [key, label, help] of NUMBERS) {
      const cell = el('div', 'wb-Number');
      cell.title = help;
      const value = el('div', 'wb-Number-value', '–');
      value.dataset.metric = key;
      cell.append(value, el('div', 'wb-Number-label', label));
      numbers.appendChild(cell);
      this._numbers.set(key, value);
    }
    root.appendChild(numbers);

    // MoE engines only: tokens per expert of each layer over the recent window, and the imbalance
    this._experts = el('div', 'wb-Experts');
    this._experts.hidden = true;
    root.appendChild(this._experts);

    const tlHead = el('div', 'wb-Row wb-TimelineHead');
    tlHead.appendChild(el('span', 'wb-Section', 'Timeline'));
    const open = el('button', 'wb-Button wb-OpenTimeline jp-mod-styled', 'Open in main area');
    open.onclick = () => this.openTimeline(this._engine);
    tlHead.appendChild(open);
    const runLog = el('button', 'wb-Button wb-OpenRuns jp-mod-styled', 'Runs');
    runLog.title = 'runs of the run log side by side: throughput, latency and the settings that differ';
    runLog.onclick = () => this.openRuns();
    tlHead.appendChild(runLog);
    root.appendChild(tlHead);
    this._timeline = new TimelineView(this.api, null, {
      rate: 5,
      stepsHeight: 150,
      lanesHeight: 190,
      window: 30,
      toolbar: false,
      rollover: 2000,
      laneLabelChars: 12,
      xTicks: 3
    });
    this._timeline.addClass('wb-Panel-timeline');
    root.appendChild(this._timeline.node);
    this._settingsBox = el('div', 'wb-Settings');
    root.appendChild(this._settingsBox);

  }

  // A collapsed sidebar still listens, but slowly.
  protected onAfterShow(): void {
    this._conn?.setRate(5);
    void this.refresh(true);
  }

  protected onAfterHide(): void {
    this._conn?.setRate(0.5);
  }

  /** Reload the engine list (and the schema the first time). */
  async refresh(quiet = false): Promise<void> {
    try {
      if (!this._schema.length) {
        this._schema = await this.api.schema();
        this._buildControls();
      }
      const engines = await this.api.listEngines();
      const names = engines.map(e => e.name);
      const picker = this._picker;
      const current = this._engine;
      const state = this._conn?.state.state;
      const over = state === 'stopped' || state === 'dead';
      // An engine that died or was stopped elsewhere stays in view, saying so, until another is
      // picked or one holds its name again: following the next engine at once hid the death.
      const kept = current && over && !names.includes(current) ? current : null;
      const wanted: Array<[string, string]> = engines.map(e => [e.name, e.model ? `${e.name} (${e.model})` : e.name]);
      if (kept) {
        wanted.push([kept, `${kept} (${state})`]);
      }
      if (!wanted.length) {
        wanted.push(['', 'no engine running']);
      }
      const key = (pairs: Array<[string, string]>) => pairs.map(([v, t]) => `${v}\t${t}`).join('\n');
      if (key(wanted) !== key([...picker.options].map(o => [o.value, o.text] as [string, string]))) {
        picker.innerHTML = '';
        for (const [value, text] of wanted) {
          const opt = el('option', undefined, text);
          opt.value = value;
          picker.appendChild(opt);
        }
      }
      if (current && names.includes(current)) {
        picker.value = current;
        if (over) {
          this.selectEngine(current); // a new engine holds the name: connect to it
        }
      } else if (kept) {
        picker.value = kept;
      } else if (!current && names.length) {
        this.selectEngine(names[0]);
      }
      if (!quiet && !kept) {
        this._say(''); // a gone engine's message stays with it
      }
    } catch (err: any) {
      if (!quiet) {
        this._say(`could not reach the server extension: ${err.message ?? err}`, true);
      }
    }
  }

  selectEngine(name: string | null): void {
    const gone = this._conn?.state.state === 'stopped' || this._conn?.state.state === 'dead';
    if (name === this._engine && this._conn && !this._conn.isDisposed && !gone) {
      return;
    }
    if (this._conn) {
      this._conn.changed.disconnect(this._onChange, this);
      this._conn.dispose();
      this._conn = null;
    }
    this._engine = name;
    this.node.dataset.engine = name ?? '';
    this._picker.value = name ?? '';
    this._stopButton.disabled = !name;
    if (name) {
      // one socket feeds the numbers, the controls and the compact timeline
      this._conn = new EngineConnection(this.api, name, 5);
      this._conn.changed.connect(this._onChange, this);
    }
    this._timeline.setEngine(name, this._conn);
    this._renderInfo();
    this._setLive(false, name ? `connecting to ${name}…` : 'no engine: start one above, or pick one when it runs');
  }

  private _onChange(conn: EngineConnection, change: IChange): void {
    if (conn !== this._conn) {
      return;
    }
    const st = conn.state;
    if (change.snapshot || change.stateChanged) {
      const reason = st.stateReason ? `: ${st.stateReason}` : '';
      this._setLive(st.state === 'ready', `engine ${this._engine} is ${st.state}${reason}: no engine to control`);
      // only a snapshot's status is fresh: a later state change (a re-layout) keeps counting
      // from it, so uptime never goes back
      if (change.snapshot) {
        this._uptimeShown = null;
        this._uptimeBase =
          typeof st.status.uptime_s === 'number' ? { value: st.status.uptime_s, at: Date.now() } : null;
      }
      this._renderInfo();
      this._renderCluster();
    }
    if (change.metricsChanged) {
      this._renderRoutes(st.metrics);
      const nums = liveNumbers(st.metrics);
      for (const [key, node] of this._numbers) {
        node.textContent = (nums as any)[key];
      }
      const kv = this._numbers.get('kv');
      if (kv && kv.parentElement) {
        kv.parentElement.title = `KV cache blocks in use${nums.kvBlocks ? `: ${nums.kvBlocks}` : ''}`;
      }
      const limit = this._numbers.get('limit');
      if (limit && limit.parentElement) {
        limit.parentElement.title = `where the last 10 s of steps spent their time${
          nums.stepParts ? `: ${nums.stepParts}` : ''}`;
      }
      this._renderExperts(st.metrics);
    }
    if (change.settingsChanged.length) {
      this._syncControls(change.settingsChanged, change.snapshot ? [] : change.settingsChanged);
    }
    if (change.error) {
      this._say(change.error, true);
    }
  }

  /** With no engine ready: say so, clear the numbers and disable the controls (changing one
   * would reach nothing); with one, enable them again. */
  private _setLive(live: boolean, why: string): void {
    const was = this._live;
    this._live = live;
    this.node.dataset.live = live ? '1' : '0';
    for (const c of this._controls.values()) {
      c.input.disabled = !live || c.input.dataset.fixed === '1';
    }
    if (!live) {
      for (const node of this._numbers.values()) {
        node.textContent = '–';
      }
      this._renderExperts({});
      this._say(why);
    } else if (!was) {
      // a confirmation waiting for the engine to be live (Start) shows now, instead of nothing
      this._say(this._notice ?? '');
      this._notice = null;
    }
  }

  private _renderExperts(metrics: Record<string, any>): void {
    const heat = expertHeatmap(metrics);
    this._experts.hidden = heat === null;
    if (heat === null) {
      this._experts.innerHTML = '';
      return;
    }
    this._experts.innerHTML = '';
    const worst = heat.worst === null ? '' : ` · worst imbalance ${heat.worst.toFixed(2)}x`;
    this._experts.appendChild(el('div', 'wb-Section', `Expert routing (recent)${worst}`));
    for (const row of heat.rows) {
      const line = el('div', 'wb-ExpertRow');
      line.title = `MoE layer ${row.layer}: busiest / mean ${row.imbalance === null ? '–' : row.imbalance.toFixed(2)}x`;
      line.appendChild(el('span', 'wb-ExpertLayer', `L${row.layer}`));
      for (const c of row.cells) {
        const cell = el('span', 'wb-ExpertCell');
        cell.style.background = c.color;
        cell.title = `layer ${row.layer}, expert ${c.expert}: ${c.tokens} tokens (${(c.share * 100).toFixed(1)}%)`;
        line.appendChild(cell);
      }
      this._experts.appendChild(line);
    }
  }

  private _renderInfo(): void {
    const st = this._conn?.state;
    const info = this._info;
    info.innerHTML = '';
    if (!this._engine || !st) {
      info.appendChild(el('div', 'wb-Dim', 'No engine selected. Start one here, with %engine start in a notebook, or `workbench serve`.'));
      return;
    }
    const s = st.status;
    const rows: Array<[string, string]> = [
      ['state', st.state + (st.stateReason ? ` (${st.stateReason})` : '')],
      ['model', String(s.model ?? '–')],
      ['device', `${s.device ?? '–'}${s.dtype ? ` · ${s.dtype}` : ''}`],
      ...(s.kernel_variant ? [['kernels', kernelsText(s)] as [string, string]] : []),
      ['uptime', formatUptime(this._uptime())],
      ['pid', String(s.pid ?? '–')]
    ];
    const last = st.relayout.length ? st.relayout[st.relayout.length - 1] : null;
    if (last) {
      rows.push(['relayout', `${last.setting} = ${JSON.stringify(last.value)}: ${last.state}`]);
    }
    const table = el('table', 'wb-InfoTable');
    for (const [k, v] of rows) {
      const tr = el('tr');
      const td = el('td', `wb-Info-${k}`, v);
      if (k === 'kernels') {
        td.title = `${s.kernel_variant_reason}; large steps: ${s.compute_path_reason}`;  // why, on hover
        if (s.prefill_attention) {
          td.title += `; prefill attention: ${s.prefill_attention_reason}`;
        }
      }
      tr.append(el('th', undefined, k), td);
      table.appendChild(tr);
    }
    info.appendChild(table);
    this.node.dataset.state = st.state;
  }

  /** A router's share of answered requests per member (metrics.router), live; hidden otherwise. */
  private _renderRoutes(metrics: Record<string, any>): void {
    const router = metrics?.router;
    const share = router && typeof router.share === 'object' && !Array.isArray(router.share) ? router.share : null;
    const served = share ? Object.values(router.served ?? {}).reduce((a: number, b: any) => a + Number(b), 0) : 0;
    this._routes.hidden = !share;
    if (!share) {
      return;
    }
    const parts = Object.entries(share).map(([name, v]) => `${name} ${(Number(v) * 100).toFixed(0)}%`);
    this._routes.textContent = served
      ? `routed (${router.policy}): ${parts.join(' · ')} of ${served} request${served === 1 ? '' : 's'}`
      : `router (${router.policy}): no request answered yet`;
  }

  /** The replica and router pickers, from the cluster's status (hidden for a single engine). */
  private _renderCluster(): void {
    const s = this._conn?.state.status ?? {};
    const replicas: Array<Record<string, any>> = Array.isArray(s.replicas) ? s.replicas : [];
    this._clusterRow.hidden = !s.cluster;
    // the process that started a cluster owns its replicas: it stops them (c.shutdown())
    const running = this._conn?.state.state === 'ready';
    const owned = Boolean(s.cluster) || Boolean(s.router_name);
    this._stopButton.disabled = !this._engine || owned || !running;
    this._stopButton.title = owned
      ? 'a cluster or router is stopped by the process that started it: shutdown() there'
      : running
        ? 'stop this engine'
        : 'no running engine selected';
    if (!s.cluster) {
      return;
    }
    const picked = this._replicaPicker.value;
    this._replicaPicker.innerHTML = '';
    const all = el('option', undefined, `all ${replicas.length} replicas`);
    all.value = '';
    this._replicaPicker.appendChild(all);
    for (const r of replicas) {
      const opt = el('option', undefined, `${r.name}${r.alive ? '' : ' (down)'} · ${r.served ?? 0} served`);
      opt.value = String(r.name);
      this._replicaPicker.appendChild(opt);
    }
    this._replicaPicker.value = replicas.some(r => r.name === picked) ? picked : '';
    const policies: string[] = Array.isArray(s.routers) ? s.routers : [String(s.router)];
    this._routerPicker.innerHTML = '';
    for (const p of policies) {
      const opt = el('option', undefined, `router: ${p}`);
      opt.value = p;
      this._routerPicker.appendChild(opt);
    }
    this._routerPicker.value = String(s.router);
  }

  private async _setRouter(policy: string): Promise<void> {
    const name = this._engine;
    if (!name) {
      return;
    }
    try {
      const settings = await this.api.configure(name, { router: policy });
      if (this._conn && this._conn.name === name) {
        this._conn.state.status = { ...this._conn.state.status, router: settings.router };
      }
      this._say(`router = ${settings.router}`);
    } catch (err: any) {
      this._say(err instanceof WorkbenchError ? err.message : String(err.message ?? err), true);
      this._renderCluster();
    }
  }

  private _uptime(): number | null {
    if (!this._uptimeBase) {
      return null;
    }
    // counting through a re-layout; frozen where the engine went away
    const state = this._conn?.state.state;
    if (state !== 'dead' && state !== 'stopped') {
      this._uptimeShown = this._uptimeBase.value + (Date.now() - this._uptimeBase.at) / 1000;
    }
    return this._uptimeShown ?? this._uptimeBase.value;
  }

  private _tickUptime(): void {
    const cell = this._info.querySelector('.wb-Info-uptime');
    if (cell) {
      cell.textContent = formatUptime(this._uptime());
    }
  }

  /** One control per setting, grouped by kind; restart-only ones are shown read-only. */
  private _buildControls(): void {
    const box = this._settingsBox;
    box.innerHTML = '';
    this._controls.clear();
    // The headline toggles (batching, KV cache, prefix caching, quantisation, speculative
    // decoding) first and open, whatever their kind; then the rest by kind.
    const groups: Array<[string, ISettingSchema[]]> = [['headline', this._schema.filter(s => s.headline)]];
    for (const kind of ['live', 'relayout', 'reload', 'restart', 'read-only']) {
      groups.push([kind, this._schema.filter(s => s.kind === kind && !s.headline)]);
    }
    for (const [group, specs] of groups) {
      if (!specs.length) {
        continue;
      }
      const section = el('details', `wb-SettingsGroup wb-group-${group}`);
      section.open = group === 'headline' || group === 'live';
      section.appendChild(el('summary', 'wb-Section', KIND_TITLES[group] ?? group));
      for (const spec of specs) {
        const kind = spec.kind;
        section.appendChild(this._control(spec, kind === 'restart' || kind === 'read-only' || spec.read_only === true));
      }
      box.appendChild(section);
    }
  }

  private _control(spec: ISettingSchema, readOnly: boolean): HTMLElement {
    const row = el('div', 'wb-Setting');
    row.dataset.setting = spec.name;
    const pause = spec.kind === 'relayout' ? ' Re-lays out weights or cache: the engine pauses while it does.' : '';
    row.title = `${spec.name}: ${spec.help}.${pause}`;
    const label = el('label', 'wb-Setting-label', spec.label ?? spec.name);
    let input: HTMLInputElement | HTMLSelectElement;
    if (spec.type === 'bool') {
      input = el('input', 'wb-Setting-input');
      input.type = 'checkbox';
    } else if (spec.type === 'enum' && spec.values) {
      input = el('select', 'wb-Setting-input jp-mod-styled');
      for (const v of spec.values) {
        const opt = el('option', undefined, String(v));
        opt.value = String(v);
        input.appendChild(opt);
      }
    } else {
      input = el('input', 'wb-Setting-input jp-mod-styled');
      if (spec.type === 'int') {
        input.type = 'number';
        input.step = '1';
        if (typeof spec.min === 'number') {
          input.min = String(spec.min);
        }
        if (typeof spec.max === 'number') {
          input.max = String(spec.max);
        }
      } else {
        input.type = 'text';
      }
      if (spec.allow_none) {
        input.placeholder = 'None';
      }
    }
    input.name = spec.name;
    input.disabled = readOnly || !this._live;
    if (readOnly) {
      input.dataset.fixed = '1'; // stays disabled whatever the engine's state
    }
    const error = el('div', 'wb-Setting-error');
    if (!readOnly) {
      input.addEventListener('change', () => void this._apply(spec, input, error));
    }
    row.append(label, input, error);
    this._controls.set(spec.name, { spec, input, error });
    return row;
  }

  private _syncControls(names: string[], changed?: string[]): void {
    const settings = this._conn?.state.settings ?? {};
    const change = changed ? new Set(changed) : null;
    for (const name of names) {
      const c = this._controls.get(name);
      if (!c || !(name in settings) || document.activeElement === c.input) {
        continue;
      }
      this._show(c.spec, c.input, settings[name]);
      // A delta sent before the refusal can arrive after it: only a new value clears the error.
      if ((!change || change.has(name)) && settings[name] !== c.refused) {
        c.error.textContent = ''; // the setting moved on since the refused attempt
        c.input.classList.remove('wb-invalid');
        c.refused = undefined;
      }
    }
  }

  private _show(spec: ISettingSchema, input: HTMLInputElement | HTMLSelectElement, value: any): void {
    if (spec.type === 'bool') {
      (input as HTMLInputElement).checked = Boolean(value);
    } else {
      input.value = value === null || value === undefined ? '' : String(value);
    }
  }

  private async _apply(spec: ISettingSchema, input: HTMLInputElement | HTMLSelectElement, error: HTMLElement): Promise<void> {
    const name = this._engine;
    if (!name) {
      return;
    }
    const value = controlValue(spec, input);
    error.textContent = '';
    input.classList.remove('wb-invalid');
    input.classList.add('wb-pending');
    try {
      const replica = this._clusterRow.hidden ? '' : this._replicaPicker.value;
      const settings = await this.api.configure(name, replica ? { [spec.name]: value, replica } : { [spec.name]: value });
      if (this._conn && this._conn.name === name) {
        this._conn.state.settings = { ...this._conn.state.settings, ...settings };
      }
      // What the user typed while this call was out is theirs: only an untouched box shows the answer.
      if (document.activeElement !== input || controlValue(spec, input) === value) {
        this._show(spec, input, settings[spec.name]);
      }
      this._say(`${spec.name} = ${JSON.stringify(settings[spec.name])}${replica ? ` on ${replica}` : ''}`);
      const control = this._controls.get(spec.name);
      if (control) {
        control.refused = undefined;
      }
    } catch (err: any) {
      const message = err instanceof WorkbenchError ? err.message : String(err.message ?? err);
      error.textContent = message;
      input.classList.add('wb-invalid');
      const current = this._conn?.state.settings?.[spec.name];
      const control = this._controls.get(spec.name);
      if (control) {
        control.refused = current;
      }
      if (current !== undefined) {
        this._show(spec, input, current);
      }
    } finally {
      input.classList.remove('wb-pending');
    }
  }

  private async _start(): Promise<void> {
    const name = this._startName.value.trim() || undefined;
    const model = this._startModel.value.trim() || null;
    this._startButton.disabled = true;
    this._say(`starting ${name ?? 'an engine'}… (loading the model)`);
    try {
      const res = await this.api.start({ name, model });
      this._notice = `started engine ${res.name}${model ? ` (${model})` : ' (the embedded default model)'}: it is selected below`;
      this._say(this._notice);
      await this.refresh(true);
      this.selectEngine(res.name);
    } catch (err: any) {
      this._say(`could not start: ${err.message ?? err}`, true);
    } finally {
      this._startButton.disabled = false;
    }
  }

  private async _stop(): Promise<void> {
    const name = this._engine;
    if (!name) {
      return;
    }
    // A shared engine: say who loses it before stopping it (this lab's server is one client).
    const clients = this._conn?.state.status.num_clients;
    const who =
      typeof clients === 'number'
        ? `${clients} client${clients === 1 ? '' : 's'} attached (this JupyterLab counts as one); `
        : '';
    const answer = await showDialog({
      title: `Stop engine ${name}?`,
      body: `${who}every notebook using it loses its engine, and running requests are aborted.`,
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Stop engine' })]
    });
    if (!answer.button.accept) {
      return;
    }
    this._stopButton.disabled = true;
    this._say(`stopping ${name}…`);
    try {
      await this.api.stop(name);
      this._say(`stopped ${name}`);
    } catch (err: any) {
      this._say(`could not stop ${name}: ${err.message ?? err}`, true);
      this._stopButton.disabled = false; // still running: it may be stopped again
    } finally {
      // The panel's own Stop moves on at once, to another running engine or to none (the button
      // stays off until a live engine is in view).
      if (this._engine === name) {
        const engines = await this.api.listEngines().catch(() => []);
        this.selectEngine(engines.map(e => e.name).find(n => n !== name) ?? null);
      }
      await this.refresh(true);
    }
  }

  private _say(text: string, isError = false): void {
    this._message.textContent = text;
    this._message.classList.toggle('wb-error', isError);
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    clearInterval(this._poll);
    this._conn?.dispose();
    this._timeline.dispose();
    super.dispose();
  }
}
