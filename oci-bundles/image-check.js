'use strict';
// The sandbox image's npm packages (docs/sandbox-image.md): each loads by `require` and by
// `import`, from any directory (they live in /usr/local/lib/node_modules, reached through the
// /node_modules link). Run at image build and by tests/toolbox.rs through a real worker.
// Prints `ok <name> <version> require import` per package, then `loaded <n>`; exits 1 on the
// first one missing.
const fs = require('fs');
const path = require('path');

const PACKAGES = ['lodash', 'axios', 'dayjs', 'csv-parse', 'papaparse', 'uuid', 'xlsx'];

(async () => {
  for (const name of PACKAGES) {
    const required = require(name);
    const imported = await import(name);
    if (!required || !imported) throw new Error(`${name} loaded empty`);
    // Not require(`${name}/package.json`): a package's "exports" may not export it.
    const dir = require.resolve.paths(name).map((p) => path.join(p, name)).find((d) => fs.existsSync(path.join(d, 'package.json')));
    const { version } = JSON.parse(fs.readFileSync(path.join(dir, 'package.json'), 'utf8'));
    console.log('ok', name, version, 'require', 'import');
  }
  console.log('loaded', PACKAGES.length);
})().catch((e) => {
  console.error(e);
  process.exit(1);
});
