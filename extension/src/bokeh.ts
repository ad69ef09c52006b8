/**
 * BokehJS, loaded from the installed `bokeh` Python package through the server extension
 * (`<base>/workbench/static/bokeh/`), so the JS always matches the Python package (and the
 * notebook dashboard, which embeds the same version). Nothing is bundled or fetched from a CDN.
 */
import { bokehScriptUrl } from './url';
import {
  changeMarkers,
  Columns,
  EngineState,
  hostColumns,
  IChangeMarker,
  laneLabels,
  latestActivity,
  PHASES,
  requestColumns,
  spanCounts,
  stepColumns
} from './model';

// BokehJS has no typings on the page; the little we use is typed loosely here.
type BokehNS = any;

declare global {
  interface Window {
    Bokeh?: BokehNS;
  }
}

// The widgets and tables bundles too: a notebook's Bokeh output (a Div, a DataTable) renders
// through whichever BokehJS is on the page first, and that may be this one.
const FILES = ['bokeh.min.js', 'bokeh-widgets.min.js', 'bokeh-tables.min.js', 'bokeh-api.min.js'];
let loading: Promise<BokehNS> | null = null;

function addScript(src: string): Promise<void> {
  return new Promise((resolve, reject) => {
    const el = document.createElement('script');
    el.src = src;
    el.async = false;
    el.dataset.workbench = 'bokeh';
    el.onload = () => resolve();
    el.onerror = () => reject(new Error(`could not load ${src}`));
    document.head.appendChild(el);
  });
}

/** Window.Bokeh with the plotting API, loading the scripts once. */
export function loadBokeh(baseUrl: string): Promise<BokehNS> {
  if (window.Bokeh && window.Bokeh.Plotting) {
    return Promise.resolve(window.Bokeh);
  }
  if (!loading) {
    loading = (async () => {
      if (!window.Bokeh) {
        for (const file of FILES.slice(0, 3)) {
          await addScript(bokehScriptUrl(baseUrl, file));
        }
      }
      if (!window.Bokeh.Plotting) {
        await addScript(bokehScriptUrl(baseUrl, FILES[3]));
      }
      if (!window.Bokeh || !window.Bokeh.Plotting) {
        throw new Error('BokehJS loaded without its plotting API');
      }
      return window.Bokeh;
    })();
    loading.catch(() => {
      loading = null;
    });
  }
  return loading;
}

/** Remove rendered Bokeh views from the page; returns the empty list to keep. */
export function removeViews(views: any[]): any[] {
  for (const v of views) {
    try {
      v.remove();
    } catch {
      // already gone
    }
  }
  return [];
}

export interface IChartOptions {
  /** Height of the steps track and of the request lanes, in px. */
  stepsHeight?: number;
  lanesHeight?: number;
  /** The widest x range shown while following the latest activity (s). */
  window?: number;
  /** Steps kept in the chart's data source. */
  rollover?: number;
  toolbar?: boolean;
  /** Characters of a lane's name (its request's prompt start) on the y axis. */
  laneLabelChars?: number;
  /** Height of the host plot (CPU, memory, KV cache) under the lanes; 0 or absent: none. */
  hostHeight?: number;
  /** About how many time-axis ticks (a narrow panel wants few, so labels never overlap). */
  xTicks?: number;
}

// The steps track: one row per phase, and on top a row of settings-change markers.
const STEP_ROWS = [...PHASES].reverse().concat(['settings']);
const MARKER_COLOR = '#C44E52'; // CHANGE_COLOR in workbench/jupyter/reducer.py

/**
 * Engine steps by phase (one row per phase) above request lanes (queued / prefill / decode / verify),
 * sharing a time axis. While following (the default), the axis fits the latest burst of
 * activity; panning or zooming stops following until `setFollow(true)`. Every settings change
 * is a dashed line across both plots, a marker on top (hover: what changed, who, how long it took)
 * and, for a re-layout, a hatched bar in the "relayout" row for as long as it stalled the engine.
 */
export class TimelineChart {
  constructor(
    readonly host: HTMLElement,
    readonly state: EngineState,
    readonly options: IChartOptions = {}
  ) {}

  /** Called when following turns on or off (by the user's pan/zoom or `setFollow`). */
  onFollowChanged: ((follow: boolean) => void) | null = null;

  private _bk: BokehNS = null;
  private _steps: any = null;
  private _spans: any = null;
  private _changes: any = null;
  private _host: any = null;
  private _lanesFigure: any = null;
  private _xRange: any = null;
  private _follow = true;
  private _fitting = false;
  private _views: any[] = [];
  private _ready: Promise<void> | null = null;
  private _disposed = false;

  get ready(): boolean {
    return this._bk !== null && this._steps !== null;
  }

  get follow(): boolean {
    return this._follow;
  }

  /** Follow the latest activity (and fit to it now), or hold the range the user chose. */
  setFollow(follow: boolean): void {
    if (follow === this._follow) {
      if (follow) {
        this._fit();
      }
      return;
    }
    this._follow = follow;
    this.host.dataset.follow = String(follow);
    if (follow) {
      this._fit();
    }
    this.onFollowChanged?.(follow);
  }

  /** Build the figures (loads BokehJS first). */
  async render(baseUrl: string): Promise<void> {
    if (!this._ready) {
      this._ready = this._render(baseUrl);
    }
    return this._ready;
  }

  private async _render(baseUrl: string): Promise<void> {
    const Bokeh = await loadBokeh(baseUrl);
    if (this._disposed) {
      return;
    }
    this._bk = Bokeh;
    const opts = this.options;
    const { figure, gridplot, show } = Bokeh.Plotting;
    this._steps = new Bokeh.ColumnDataSource({ data: stepColumns(undefined) });
    this._spans = new Bokeh.ColumnDataSource({ data: requestColumns(undefined) });
    this._changes = new Bokeh.ColumnDataSource({ data: this._changeData([]) });
    this._xRange = new Bokeh.Range1d({ start: 0, end: 1 });
    // A range change this chart did not make is the user's pan or zoom: stop following.
    this._xRange.properties.start.change.connect(() => {
      if (!this._fitting && this._follow) {
        this.setFollow(false);
      }
    });
    this.host.dataset.follow = String(this._follow);
    const tools = opts.toolbar === false ? '' : 'xpan,xwheel_zoom,box_zoom,save';
    const border = Math.max(60, 6 * (opts.laneLabelChars ?? 10));
    const steps = figure({
      height: opts.stepsHeight ?? 140,
      sizing_mode: 'stretch_width',
      x_range: this._xRange,
      y_range: new Bokeh.FactorRange({ factors: STEP_ROWS }),
      tools,
      toolbar_location: opts.toolbar === false ? null : 'above',
      title: 'engine steps by phase',
      min_border_left: border
    });
    const stepBars = steps.hbar({
      y: { field: 'phase' },
      left: { field: 'left' },
      right: { field: 'right' },
      height: 0.8,
      fill_color: { field: 'color' },
      line_color: null,
      source: this._steps
    });
    steps.add_tools(
      new Bokeh.HoverTool({
        renderers: [stepBars],
        tooltips: [
          ['step', '@seq (@phase)'],
          ['batch', '@batch: @composition'],
          ['tokens', '@tokens'],
          ['took', '@ms{0.0} ms'],
          ['drafts kept', '@spec'],
          ['time went to', '@parts'],
          ['bound', '@bound']
        ]
      })
    );
    steps.hbar({
      y: { value: 'relayout' },
      left: { field: 't' },
      right: { field: 'end' },
      height: 0.8,
      fill_color: this.state.palette.phase.relayout ?? '#8C8C8C',
      hatch_pattern: '/',
      hatch_color: 'white',
      line_color: null,
      source: this._changes
    });
    const marks = steps.scatter({
      x: { field: 't' },
      y: { value: 'settings' },
      marker: 'inverted_triangle',
      size: 11,
      fill_color: MARKER_COLOR,
      line_color: MARKER_COLOR,
      source: this._changes
    });
    steps.add_tools(
      new Bokeh.HoverTool({
        renderers: [marks],
        tooltips: [
          ['changed', '@label'],
          ['by', '@by'],
          ['applied in', '@apply_ms{0.0} ms'],
          ['at', '@t_ms{0,0.0} ms']
        ]
      })
    );
    steps.xaxis.visible = false;
    this._changeLines(steps);
    const lanes = figure({
      height: opts.lanesHeight ?? 200,
      sizing_mode: 'stretch_width',
      x_range: this._xRange,
      y_range: new Bokeh.DataRange1d({ flipped: true, range_padding: 0.05 }),
      tools,
      toolbar_location: opts.toolbar === false ? null : 'above',
      title: 'requests by prompt (queued / prefill / decode / verify)',
      x_axis_label: 'engine time (s)',
      min_border_left: border
    });
    const spanBars = lanes.hbar({
      y: { field: 'lane' },
      left: { field: 'left' },
      right: { field: 'right' },
      height: 0.7,
      fill_color: { field: 'color' },
      line_color: null,
      source: this._spans
    });
    lanes.add_tools(
      new Bokeh.HoverTool({
        renderers: [spanBars],
        tooltips: [
          ['request', '@label'],
          ['id', '@request_id (lane @lane)'],
          ['state', '@kind for @ms{0,0.0} ms'],
          ['from', '@start_ms{0,0.0} ms']
        ]
      })
    );
    this._changeLines(lanes);
    lanes.yaxis.ticker = new Bokeh.BasicTicker({ min_interval: 1, num_minor_ticks: 0 });
    const xTicks = opts.xTicks ?? 6;
    lanes.xaxis.ticker = new Bokeh.BasicTicker({ desired_num_ticks: xTicks });
    this.host.dataset.xTicks = String(xTicks);
    lanes.yaxis.major_label_text_font_size = '8pt';
    lanes.ygrid.visible = false;
    this._lanesFigure = lanes;
    const rows: any[][] = [[steps], [lanes]];
    if (opts.hostHeight) {
      rows.push([this._hostFigure(Bokeh, figure, tools, border)]);
    }
    const grid = gridplot(rows, {
      sizing_mode: 'stretch_width',
      toolbar_location: opts.toolbar === false ? null : 'right',
      merge_tools: true
    });
    const views = await show(grid, this.host);
    this._views = Array.isArray(views) ? views : [views];
    if (this._disposed) {
      this._removeViews();
      return;
    }
    this.reset();
  }

  /** What serving costs the machine, on the timeline's axis: CPU (engine, host), memory, KV cache. */
  private _hostFigure(Bokeh: BokehNS, figure: any, tools: string, border: number): any {
    this._host = new Bokeh.ColumnDataSource({ data: hostColumns(undefined) });
    const host = figure({
      height: this.options.hostHeight,
      sizing_mode: 'stretch_width',
      x_range: this._xRange,
      y_range: new Bokeh.Range1d({ start: -2, end: 102 }),
      tools,
      toolbar_location: null,
      title: 'host: CPU, memory and KV cache in use (% of the host)',
      min_border_left: border
    });
    const palette = this.state.palette.phase;
    const lines: Array<[string, string, string]> = [
      ['engine_cpu_pct', 'engine CPU', palette.prefill ?? '#4C72B0'],
      ['host_cpu_pct', 'host CPU', palette.mixed ?? '#8172B3'],
      ['host_mem_pct', 'host memory', palette.relayout ?? '#8C8C8C'],
      ['kv_pct', 'KV cache', palette.decode ?? '#55A868']
    ];
    for (const [field, label, color] of lines) {
      host.line({
        x: { field: 't' },
        y: { field },
        line_width: 2,
        line_color: color,
        legend_label: label,
        source: this._host
      });
    }
    host.legend.location = 'top_left';
    host.legend.orientation = 'horizontal';
    host.legend.label_text_font_size = '8pt';
    host.add_tools(
      new Bokeh.HoverTool({
        mode: 'vline',
        tooltips: [
          ['engine CPU', '@engine_cpu_pct{0.0} %'],
          ['host CPU', '@host_cpu_pct{0.0} %'],
          ['host memory', '@host_mem_pct{0.0} %'],
          ['engine memory', '@engine_rss_mb{0,0} MiB'],
          ['KV cache', '@kv_pct{0.0} %']
        ]
      })
    );
    this._changeLines(host);
    return host;
  }

  /** Redraw everything from the state (after a snapshot, or once the figures exist). */
  reset(): void {
    if (!this.ready) {
      return;
    }
    this._steps.data = stepColumns(this.state.columns.steps);
    this._spans.data = requestColumns(this.state.columns.lanes);
    if (this._host) {
      this._host.data = hostColumns(this.state.columns.host);
    }
    this._drawChanges();
    this._afterData();
  }

  /** Append the reducer's new rows (streamed; older ones roll over). */
  add(columns: Record<string, Columns>): void {
    if (!this.ready) {
      return; // reset() draws everything from the state once the figures exist
    }
    if (columns.steps) {
      this._steps.stream(stepColumns(columns.steps), this.options.rollover ?? 5000);
    }
    if (columns.lanes) {
      this._spans.stream(requestColumns(columns.lanes), this.state.maxLaneRows);
    }
    if (columns.changes) {
      this._drawChanges();
    }
    if (columns.host && this._host) {
      this._host.stream(hostColumns(columns.host), 3600);
      this.host.dataset.hostRows = String(this._host.data.t.length);
    }
    this._afterData();
  }

  private _afterData(): void {
    const names = laneLabels(this.state.columns.lanes, this.options.laneLabelChars ?? 10);
    this.host.dataset.laneLabels = JSON.stringify(names);
    this._lanesFigure.yaxis.major_label_overrides = new Map(
      Object.entries(names).map(([lane, name]) => [Number(lane), name])
    );
    if (this._follow) {
      this._fit();
    }
    this._publishCounts();
  }

  private _fit(): void {
    if (!this.ready) {
      return;
    }
    const range = latestActivity(this.state.columns.steps, this.options.window ?? 30, 5, this.state.columns.changes);
    if (!range) {
      return;
    }
    this._fitting = true;
    try {
      this._xRange.setv(range);
    } finally {
      this._fitting = false;
    }
    this.host.dataset.xStart = range.start.toFixed(3);
    this.host.dataset.xEnd = range.end.toFixed(3);
  }

  private _changeData(markers: IChangeMarker[]): Record<string, any[]> {
    return {
      t: markers.map(m => m.t),
      end: markers.map(m => m.end),
      label: markers.map(m => m.label),
      by: markers.map(m => m.by),
      apply_ms: markers.map(m => m.applyMs),
      t_ms: markers.map(m => m.t * 1e3)
    };
  }

  /** A dashed line across the figure's full height at each change (a vspan glyph: no y extent). */
  private _changeLines(fig: any): void {
    fig.vspan({ field: 't' }, {
      line_color: MARKER_COLOR,
      line_dash: 'dashed',
      line_width: 1.5,
      line_alpha: 0.8,
      source: this._changes
    });
  }

  /** The change markers (few: the engine keeps at most 1000), redrawn whole. */
  private _drawChanges(): void {
    const markers = changeMarkers(this.state.columns.changes);
    this._changes.data = this._changeData(markers);
    this.host.dataset.changes = String(markers.length);
  }

  /** Counts exposed as data attributes (read by the browser tests and handy when debugging). */
  private _publishCounts(): void {
    const counts = spanCounts(this.state);
    const d = this.host.dataset;
    for (const [phase, n] of Object.entries(counts.steps)) {
      d[`steps${phase[0].toUpperCase()}${phase.slice(1)}`] = String(n);
    }
    for (const [kind, n] of Object.entries(counts.spans)) {
      d[`spans${kind[0].toUpperCase()}${kind.slice(1)}`] = String(n);
    }
    d.requests = String(this.state.requestCount);
    d.cursor = String(this.state.cursor);
  }

  private _removeViews(): void {
    this._views = removeViews(this._views);
  }

  dispose(): void {
    this._disposed = true;
    this._removeViews();
    this.host.innerHTML = '';
  }
}
