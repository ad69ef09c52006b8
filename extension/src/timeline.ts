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
    this.node.appendChild(bar);
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
    } else {
      chart.add(change.newColumns);
    }
    this._updateStatus();
  }

  private _updateStatus(): void {
    const conn = this._conn;
    if (!conn) {
      return;
    }
    const st = conn.state;
    const counts = spanCounts(st);
    const parts = [`${st.state}`, `${st.steps.length} steps`, `${st.requests.size} requests`];
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
