/**
 * The run log in the main area: the newest runs (bench, sweeps and their points, simulations),
 * and any two or more of them side by side — output tokens/s, latency percentiles and the
 * settings that differ. The server computes what is drawn (`workbench.runs.plots.comparison`),
 * the same columns a notebook's `workbench.runs.plot(ids)` draws.
 */
import { Widget } from '@lumino/widgets';

import { IRunComparison, IRunInfo, WorkbenchAPI } from './api';
import { loadBokeh, removeViews } from './bokeh';
import { el } from './dom';


function fmt(v: number | null | undefined, digits = 1): string {
  return typeof v === 'number' && isFinite(v) ? v.toFixed(digits) : '–';
}

export class RunsView extends Widget {
  constructor(readonly api: WorkbenchAPI) {
    super();
    this.addClass('wb-Runs');
    this.id = 'serving-workbench-runs';
    this.title.label = 'Run log';
    this.title.closable = true;
    const bar = el('div', 'wb-Runs-bar');
    const refresh = el('button', 'wb-Button jp-mod-styled', 'Refresh');
    refresh.onclick = () => void this.refresh();
    this._compare = el('button', 'wb-Button wb-Runs-compare jp-mod-styled', 'Compare selected');
    this._compare.disabled = true;
    this._compare.onclick = () => void this.compare([...this._selected]);
    this._status = el('span', 'wb-Runs-status');
    bar.append(refresh, this._compare, this._status);
    this._table = el('table', 'wb-Runs-table');
    this._chart = el('div', 'wb-Runs-chart');
    this._settings = el('div', 'wb-Runs-settings');
    this.node.append(bar, this._table, this._chart, this._settings);
    void this.refresh();
  }

  private _compare: HTMLButtonElement;
  private _status: HTMLElement;
  private _table: HTMLTableElement;
  private _chart: HTMLElement;
  private _settings: HTMLElement;
  private _selected = new Set<number>();
  private _views: any[] = [];

  async refresh(): Promise<void> {
    let runs: IRunInfo[];
    try {
      runs = await this.api.listRuns(50);
    } catch (err: any) {
      this._status.textContent = `could not read the run log: ${err.message ?? err}`;
      return;
    }
    this._table.innerHTML = '';
    const head = el('tr');
    for (const h of ['', 'id', 'kind', 'label', 'started', 'tok/s', 'TTFT p50 ms', 'ITL p50 ms']) {
      head.appendChild(el('th', undefined, h));
    }
    this._table.appendChild(head);
    for (const r of runs) {
      const row = el('tr');
      row.dataset.run = String(r.id);
      const pick = el('input');
      pick.type = 'checkbox';
      pick.checked = this._selected.has(r.id);
      pick.onchange = () => {
        if (pick.checked) {
          this._selected.add(r.id);
        } else {
          this._selected.delete(r.id);
        }
        this._compare.disabled = !this._comparable(runs);
      };
      const cell = el('td');
      cell.appendChild(pick);
      row.appendChild(cell);
      const h = r.headline ?? {};
      for (const text of [
        String(r.id),
        r.kind,
        r.label ?? '',
        (r.started_at ?? '').slice(0, 19).replace('T', ' '),
        fmt(h.output_tok_s),
        fmt(h.ttft_p50_ms, 0),
        fmt(h.itl_p50_ms)
      ]) {
        row.appendChild(el('td', undefined, text));
      }
      this._table.appendChild(row);
    }
    this._status.textContent = runs.length
      ? `${runs.length} runs; tick two or more, or one sweep (its points), to compare`
      : 'no runs yet: `workbench bench`, a sweep or a simulation records one';
    this._compare.disabled = !this._comparable(runs);
  }

  /** Two or more runs, or one sweep (the server expands it to its points). */
  private _comparable(runs: IRunInfo[]): boolean {
    const sweeps = runs.filter(r => r.kind === 'sweep' && this._selected.has(r.id)).length;
    return this._selected.size >= 2 || sweeps > 0;
  }

  /** Draw `ids` side by side. */
  async compare(ids: number[]): Promise<void> {
    let comp: IRunComparison;
    try {
      comp = await this.api.compareRuns(ids);
    } catch (err: any) {
      this._status.textContent = `could not compare: ${err.message ?? err}`;
      return;
    }
    this._drawSettings(comp);
    await this._drawBars(comp);
    this.node.dataset.compared = ids.join(',');
    this._status.textContent = `comparing ${comp.runs.join(', ')}`;
  }

  private _drawSettings(comp: IRunComparison): void {
    const box = this._settings;
    box.innerHTML = '';
    box.appendChild(el('div', 'wb-Section', 'Settings that differ'));
    if (!comp.settings.length) {
      box.appendChild(el('div', 'wb-Dim', 'no setting differs between these runs'));
    } else {
      const table = el('table', 'wb-Runs-table');
      const head = el('tr');
      head.appendChild(el('th', undefined, 'setting'));
      comp.runs.forEach((r, i) => {
        const th = el('th', undefined, r);
        th.style.color = comp.colors[i];
        head.appendChild(th);
      });
      table.appendChild(head);
      for (const s of comp.settings) {
        const row = el('tr');
        row.dataset.setting = s.setting;
        row.appendChild(el('td', undefined, s.setting));
        for (const v of s.values) {
          row.appendChild(el('td', undefined, v));
        }
        table.appendChild(row);
      }
      box.appendChild(table);
    }
    const caveats = [
      comp.same_workload === false ? 'different workloads' : '',
      comp.same_weights === false ? 'different weights' : ''
    ].filter(Boolean);
    if (caveats.length) {
      box.appendChild(el('div', 'wb-Setting-error', `Caution: ${caveats.join(' and ')}; not like for like.`));
    }
  }

  private async _drawBars(comp: IRunComparison): Promise<void> {
    const Bokeh = await loadBokeh(this.api.baseUrl);
    this._views = removeViews(this._views);
    const { figure, show } = Bokeh.Plotting;
    const figs: any[] = [];
    for (const { rows: bars, title, unit } of comp.figures) {
      if (!bars.metric.length) {
        continue;
      }
      // the x axis names a run by its id ("#5"): the full names head the settings table and the tooltips
      const short = (run: string) => run.split(' ')[0];
      const x = bars.metric.map((m, i) => [m, short(bars.run[i])]);
      const factors: string[][] = [];
      for (const f of x) {
        if (!factors.some(g => g[0] === f[0] && g[1] === f[1])) {
          factors.push(f);
        }
      }
      const source = new Bokeh.ColumnDataSource({
        data: { x, value: bars.value.map(v => (v === null ? NaN : v)), color: bars.color, run: bars.run, metric: bars.metric }
      });
      const fig = figure({
        x_range: new Bokeh.FactorRange({ factors, group_padding: 0.6 }),
        height: 280,
        sizing_mode: 'stretch_width',
        title,
        y_axis_label: unit,
        tools: 'save',
        toolbar_location: 'above'
      });
      fig.vbar({ x: { field: 'x' }, top: { field: 'value' }, width: 0.85, fill_color: { field: 'color' }, line_color: null, source });
      fig.add_tools(
        new Bokeh.HoverTool({ tooltips: [['run', '@run'], ['metric', '@metric'], ['value', `@value{0.0} ${unit}`]] })
      );
      fig.y_range.start = 0;
      figs.push(fig);
    }
    this._chart.innerHTML = '';
    for (const fig of figs) {
      const host = el('div', 'wb-Runs-figure');
      this._chart.appendChild(host);
      const view = await show(fig, host);
      this._views.push(view);
    }
    this._chart.dataset.bars = String(comp.throughput.metric.length + comp.latency.metric.length);
    this._chart.dataset.figures = String(figs.length);
  }

  dispose(): void {
    this._views = removeViews(this._views);
    super.dispose();
  }
}

