/**
 * Serving Workbench for JupyterLab: a sidebar panel to watch and tune engines, and a live
 * timeline in the main area (command palette + launcher), restored on reload.
 */
import { ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette, MainAreaWidget, WidgetTracker } from '@jupyterlab/apputils';
import { ILauncher } from '@jupyterlab/launcher';
import { LabIcon } from '@jupyterlab/ui-components';

import { WorkbenchAPI } from './api';
import { WorkbenchPanel } from './panel';
import { RunsView } from './runs';
import { TimelineView } from './timeline';

const PLUGIN_ID = 'serving-workbench:plugin';
const CATEGORY = 'Serving Workbench';

export namespace CommandIDs {
  export const openTimeline = 'serving-workbench:open-timeline';
  export const showPanel = 'serving-workbench:show-panel';
  export const openRuns = 'serving-workbench:open-runs';
}

const SVG = `<svg xmlns="http://www.w3.org/2000/svg" width="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <rect x="2" y="4" width="9" height="3" rx="1"/>
    <rect x="8" y="9" width="13" height="3" rx="1"/>
    <rect x="4" y="14" width="6" height="3" rx="1"/>
    <rect x="11" y="19" width="10" height="3" rx="1" opacity="0.7"/>
  </g>
</svg>`;

export const workbenchIcon = new LabIcon({ name: 'serving-workbench:icon', svgstr: SVG });

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: 'Watch and tune Serving Workbench engines: panel, live timeline.',
  autoStart: true,
  optional: [ILayoutRestorer, ICommandPalette, ILauncher],
  activate: (
    app: JupyterFrontEnd,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null,
    launcher: ILauncher | null
  ) => {
    const api = new WorkbenchAPI(app.serviceManager.serverSettings);
    const tracker = new WidgetTracker<MainAreaWidget<TimelineView>>({ namespace: 'serving-workbench-timeline' });

    const panel = new WorkbenchPanel(
      api,
      engine => void app.commands.execute(CommandIDs.openTimeline, engine ? { engine } : {}),
      () => void app.commands.execute(CommandIDs.openRuns)
    );
    panel.title.icon = workbenchIcon;
    panel.title.caption = 'Serving Workbench: engines, live settings and the timeline';
    app.shell.add(panel, 'left', { rank: 600 });

    app.commands.addCommand(CommandIDs.openTimeline, {
      label: args => (args.isLauncher ? 'Engine Timeline' : 'Open Engine Timeline'),
      caption: 'Live timeline of an engine: steps by phase and request lanes',
      icon: args => (args.isPalette ? undefined : workbenchIcon),
      execute: args => {
        const engine = (args.engine as string) || panel.engine || null;
        const existing = tracker.find(w => w.content.engine === engine && engine !== null);
        if (existing) {
          app.shell.activateById(existing.id);
          return existing;
        }
        const content = new TimelineView(api, engine, {
          rate: 10,
          picker: true,
          stepsHeight: 170,
          lanesHeight: 320,
          window: 60,
          laneLabelChars: 24,
          hostHeight: 150
        });
        const widget = new MainAreaWidget({ content });
        widget.id = `serving-workbench-timeline-${Date.now()}`;
        widget.title.label = content.title.label;
        widget.title.icon = workbenchIcon;
        widget.title.closable = true;
        widget.addClass('wb-TimelineWidget');
        // keep the tab title (and the restored state) in step with the engine picked
        const sync = () => {
          widget.title.label = content.title.label;
          void tracker.save(widget);
        };
        content.title.changed.connect(sync);
        void tracker.add(widget);
        app.shell.add(widget, 'main');
        app.shell.activateById(widget.id);
        return widget;
      }
    });

    let runs: MainAreaWidget<RunsView> | null = null;
    app.commands.addCommand(CommandIDs.openRuns, {
      label: 'Open the Run Log',
      caption: 'Runs of the run log side by side: throughput, latency and the settings that differ',
      execute: () => {
        if (runs && !runs.isDisposed) {
          void runs.content.refresh();
          app.shell.activateById(runs.id);
          return runs;
        }
        runs = new MainAreaWidget({ content: new RunsView(api) });
        runs.id = 'serving-workbench-runs-area';
        runs.title.label = 'Run log';
        runs.title.icon = workbenchIcon;
        runs.title.closable = true;
        runs.addClass('wb-RunsWidget');
        app.shell.add(runs, 'main');
        app.shell.activateById(runs.id);
        return runs;
      }
    });

    app.commands.addCommand(CommandIDs.showPanel, {
      label: 'Show Serving Workbench Panel',
      execute: () => app.shell.activateById(panel.id)
    });

    if (palette) {
      palette.addItem({ command: CommandIDs.openTimeline, category: CATEGORY, args: { isPalette: true } });
      palette.addItem({ command: CommandIDs.showPanel, category: CATEGORY });
      palette.addItem({ command: CommandIDs.openRuns, category: CATEGORY });
    }
    if (launcher) {
      launcher.add({ command: CommandIDs.openTimeline, category: 'Other', rank: 50, args: { isLauncher: true } });
    }
    if (restorer) {
      restorer.add(panel, 'serving-workbench-panel');
      void restorer.restore(tracker, {
        command: CommandIDs.openTimeline,
        args: w => (w.content.engine ? { engine: w.content.engine } : {}),
        name: w => w.content.engine ?? 'none'
      });
    }
  }
};

export default plugin;
