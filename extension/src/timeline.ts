/**
 * The live timeline of one engine (steps by phase + request lanes), used in the main area and,
 * compact, at the bottom of the sidebar panel.
 */
import { Widget } from '@lumino/widgets';

import { EngineConnection, WorkbenchAPI } from './api';
import { IChartOptions, TimelineChart } from './bokeh';
import { IChange, spanCounts } from './model';

export interface ITimelineViewOptions extends IChartOptions {
  /** Websocket flush rate asked of the server (Hz). */
  rate?: number;
  /** Show the engine picker above the chart (main area). */
  picker?: boolean;
}

export class TimelineView extends Widget {
  constructor(
    readonly api: WorkbenchAPI,
    engine: string | null,
    readonly options: ITimelineViewOptions = {}
  ) {
    super();
    this.addClass('wb-Timeline');
    const bar = document.createElement('div');
    bar.className = 'wb-Timeline-bar';
    if (options.picker) {
      this._picker = document.createElement('select');
      this._picker.className = 'wb-Timeline-picker jp-mod-styled';
      this._picker.title = 'engine';
      this._picker.onchange = () => this.setEngine(this._picker!.value || null);
      this._picker.onfocus = () => void this.refreshEngines();
      bar.appendChild(this._picker);
    }
    this._status = document.createElement('span');
    this._status.className = 'wb-Timeline-status';
    bar.appendChild(this._status);
    // The first snapshot holds only the newest steps; this pages back on demand.
    this._earlier = document.createElement('button');
    this._earlier.className = 'wb-Timeline-earlier jp-mod-styled';
    this._earlier.textContent = 'earlier';
    this._earlier.title = 'load earlier steps from the engine (4x the window shown)';
    this._earlier.hidden = true;
    this._earlier.onclick = () => this._conn?.requestEarlier();
    bar.appendChild(this._earlier);
    // Follow: fit the axis to the latest activity; a pan or zoom turns it off, this turns it back on.
    const follow = document.createElement('label');
    follow.className = 'wb-Timeline-follow';
    follow.title = 'fit the time axis to the latest activity (panning or zooming stops following)';
    this._follow = document.createElement('input');
    this._follow.type = 'checkbox';
    this._follow.checked = true;
    this._follow.onchange = () => this._chart?.setFollow(this._follow.checked);
    follow.append(this._follow, ' follow');
    bar.appendChild(follow);
    this.node.appendChild(bar);
    this._legend = document.createElement('div');
    this._legend.className = 'wb-Timeline-legend';
    this.node.appendChild(this._legend);
    this._host = document.createElement('div');
    this._host.className = 'wb-Timeline-chart';
    this.node.appendChild(this._host);
    this.setEngine(engine);
    if (options.picker) {
      void this.refreshEngines();
    }
  }

  private _engine: string | null = null;
  private _conn: EngineConnection | null = null;
  private _chart: TimelineChart | null = null;
  private _host: HTMLElement;
  private _status: HTMLElement;
  private _earlier: HTMLButtonElement;
  private _follow: HTMLInputElement;
  private _legend: HTMLElement;
  private _picker: HTMLSelectElement | null = null;
  private _owned = true;

  get engine(): string | null {
    return this._engine;
  }

  get connection(): EngineConnection | null {
    return this._conn;
  }

  /** Fill the picker from the running engines (keeps the current choice). */
  async refreshEngines(): Promise<void> {
    if (!this._picker) {
      return;
    }
    let names: string[] = [];
    try {
      names = (await this.api.listEngines()).map(e => e.name);
    } catch {
      return;
    }
    if (this._engine && !names.includes(this._engine)) {
      names.unshift(this._engine);
    }
    const picker = this._picker;
    picker.innerHTML = '';
    for (const n of names) {
      const opt = document.createElement('option');
      opt.value = n;
      opt.textContent = n;
      picker.appendChild(opt);
    }
    if (this._engine) {
      picker.value = this._engine;
    } else if (names.length) {
      this.setEngine(names[0]);
    }
  }

  /** Follow another engine (null: none), over its own websocket or a shared connection. */
  setEngine(engine: string | null, shared: EngineConnection | null = null): void {
    if (engine === this._engine && this._conn && !this._conn.isDisposed && (!shared || shared === this._conn)) {
      return;
    }
    this._teardown();
    this._engine = engine;
    this.title.label = engine ? `Timeline: ${engine}` : 'Engine timeline';
    this.node.dataset.engine = engine ?? '';
    if (this._picker && engine) {
      this._picker.value = engine;
    }
    if (!engine) {
      this._status.textContent = 'no engine selected';
      return;
    }
    this._status.textContent = 'connecting…';
    const conn = shared ?? new EngineConnection(this.api, engine, this.options.rate ?? 10);
    this._owned = !shared;
    const chart = new TimelineChart(this._host, conn.state, this.options);
    chart.onFollowChanged = on => {
      this._follow.checked = on;
    };
    this._follow.checked = chart.follow;
    this._conn = conn;
    this._chart = chart;
    conn.changed.connect(this._onChange, this);
    chart
      .render(this.api.baseUrl)
      .then(() => {
        if (conn.state.hasSnapshot && this._chart === chart) {
          chart.reset();
          this._updateStatus();
        }
      })
      .catch(err => {
        this._status.textContent = `timeline unavailable: ${err.message ?? err}`;
      });
  }

  private _onChange(conn: EngineConnection, change: IChange): void {
    const chart = this._chart;
    if (!chart || conn !== this._conn) {
      return;
    }
    if (change.snapshot) {
      chart.reset();
      this._drawLegend();
    } else {
      chart.add(change.newColumns);
    }
    this._updateStatus();
  }

  /** Swatches in the reducer's palette (the one every view uses), and the change marker. */
  private _drawLegend(): void {
    const palette = this._conn?.state.palette;
    if (!palette) {
      return;
    }
    const entries: Array<[string, string]> = Object.entries(palette.state);
    for (const phase of ['mixed', 'relayout']) {
      if (palette.phase[phase]) {
        entries.push([phase, palette.phase[phase]]);
      }
    }
    this._legend.innerHTML = '';
    for (const [name, color] of entries) {
      const item = document.createElement('span');
      item.className = 'wb-Legend-item';
      const swatch = document.createElement('span');
      swatch.className = 'wb-Legend-swatch';
      swatch.style.background = color;
      item.append(swatch, name);
      this._legend.appendChild(item);
    }
    const change = document.createElement('span');
    change.className = 'wb-Legend-item';
    change.innerHTML = '<span class="wb-Legend-marker">▼</span>settings change';
    this._legend.appendChild(change);
  }

  private _updateStatus(): void {
    const conn = this._conn;
    if (!conn) {
      return;
    }
    const st = conn.state;
    const counts = spanCounts(st);
    const parts = [`${st.state}`, `${st.steps.length} steps`, `${st.requestCount} requests`];
    if (counts.spans.decode || counts.spans.prefill) {
      parts.push(`${st.activeRequests} active`);
    }
    if (conn.error) {
      parts.push(`error: ${conn.error}`);
    }
    this._status.textContent = parts.join(' · ');
    this._earlier.hidden = !st.older;
    this.node.dataset.state = st.state;
  }

  private _teardown(): void {
    if (this._conn) {
      this._conn.changed.disconnect(this._onChange, this);
      if (this._owned) {
        this._conn.dispose();
      }
      this._conn = null;
    }
    if (this._chart) {
      this._chart.dispose();
      this._chart = null;
    }
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._teardown();
    super.dispose();
  }
}
