'use strict';
// sandq notebook runner for Node.js.
//
//     node sandq_runner.js <script> [args...]
//     node sandq_runner.js --warm          (a warm sandbox: waits for the worker's handover)
//
// Runs the whole script like one notebook cell and appends each output as one JSON line to
// $SANDQ_OUTPUTS (the same lines as sandq_runner.py):
//
//     {"output_type": "execute_result", "data": {"text/plain": "42"}, "metadata": {}}
//     {"output_type": "error", "ename": ..., "evalue": ..., "traceback": [lines]}
//
// The script runs as the body of an async function (so top-level `await` works), with
// CommonJS's `require`, `module`, `exports`, `__filename` and `__dirname`; static `import` /
// `export` are rewritten to `await import()` and plain declarations. The value of its last
// expression statement is the cell's result. Every rewrite keeps the script's lines (and the
// columns of everything but the rewritten text), so stack traces name the user's lines.
// stdout/stderr go to fd 1 / fd 2 unchanged. Exit status follows plain node: 0 (or
// process.exitCode), 1 after an uncaught error or unhandled rejection, process.exit(n)'s n.
// See README.md next to this file.

const fs = require('fs');
const path = require('path');
const util = require('util');
const vm = require('vm');
const Module = require('module');
const { pathToFileURL } = require('url');

const RUNNER_FILE = __filename;
/** `process.exit` as node made it: the script may replace the property. */
const exit = process.exit.bind(process);

// ------------------------------------------------------------------------------------------
// output file

function note(message) {
  try {
    fs.writeSync(2, `sandq: ${message}\n`);
  } catch {
    // nowhere to say it
  }
}

function outputLimit() {
  const value = (process.env.SANDQ_OUTPUT_LIMIT || '').trim();
  if (!value) return null;
  if (!/^\d+$/.test(value)) {
    note(`ignoring SANDQ_OUTPUT_LIMIT=${JSON.stringify(value)} (not an integer)`);
    return null;
  }
  return Number(value);
}

/** Appends one JSON line per output to $SANDQ_OUTPUTS, within $SANDQ_OUTPUT_LIMIT bytes. */
class Outputs {
  constructor(file, limit) {
    this.fd = null;
    this.limit = limit;
    this.written = 0;
    this.stopped = false;
    if (file) {
      try {
        this.fd = fs.openSync(file, fs.constants.O_WRONLY | fs.constants.O_CREAT | fs.constants.O_APPEND, 0o644);
      } catch (e) {
        note(`cannot open outputs file ${file}: ${e.message}; outputs are not saved`);
      }
    }
  }

  write(output) {
    if (this.fd === null || this.stopped) return;
    // A lone surrogate would be escaped as `\ud800`, which strict JSON readers refuse.
    const json = JSON.stringify(output, (key, value) => (typeof value === 'string' ? value.toWellFormed() : value));
    const line = Buffer.from(`${json}\n`, 'utf8');
    if (this.limit !== null && this.written + line.length > this.limit) {
      this.stopped = true;
      note(`output limit of ${this.limit} bytes reached: this and all later outputs (results, errors) were dropped`);
      return;
    }
    try {
      let offset = 0;
      while (offset < line.length) offset += fs.writeSync(this.fd, line, offset);
    } catch (e) {
      this.stopped = true;
      note(`cannot write outputs file: ${e.message}; later outputs are dropped`);
      return;
    }
    this.written += line.length;
  }
}

// ------------------------------------------------------------------------------------------
// formatting values and errors

function safeInspect(value) {
  try {
    return util.inspect(value);
  } catch {
    try {
      return String(value);
    } catch {
      return '<unrepresentable value>';
    }
  }
}

function safeString(value, fallback) {
  try {
    return String(value);
  } catch {
    return fallback;
  }
}

function isErrorLike(value) {
  return value !== null && typeof value === 'object' && (value instanceof Error || typeof value.stack === 'string');
}

/** The frame lines ("    at ...") and the header lines before them of an error's stack. */
function splitStack(stack) {
  const lines = stack.split('\n');
  const first = lines.findIndex((l) => /^\s+at /.test(l));
  return first < 0 ? { header: lines, frames: [] } : { header: lines.slice(0, first), frames: lines.slice(first) };
}

/** Whether a frame line points into `file`. */
function frameIn(line, file) {
  return line.includes(`(${file}:`) || line.includes(` ${file}:`) || line.includes(`(${pathToFileURL(file).href}:`);
}

/**
 * The user's frames: everything up to the outermost frame in the script (the frames of code
 * the script called, library or built-in, stay); the runner's own frames and the Node.js
 * machinery that started it are left out.
 */
function userFrames(frames, script) {
  let last = -1;
  frames.forEach((line, i) => {
    if (frameIn(line, script)) last = i;
  });
  const kept = last >= 0 ? frames.slice(0, last + 1) : frames;
  return kept.filter((line) => !frameIn(line, RUNNER_FILE));
}

/** `{name, value, traceback}` of anything thrown. */
function describe(error, script) {
  if (isErrorLike(error)) {
    const name = safeString(error.name, 'Error');
    const value = safeString(error.message, '');
    let stack = null;
    try {
      stack = typeof error.stack === 'string' ? error.stack : null;
    } catch {
      // a throwing getter
    }
    const { header, frames } = splitStack(stack || `${name}: ${value}`);
    return { name, value, traceback: header.concat(userFrames(frames, script)) };
  }
  const shown = safeInspect(error);
  let name = typeof error;
  if (error !== null && typeof error === 'object') {
    try {
      name = (error.constructor && error.constructor.name) || 'Object';
    } catch {
      name = 'Object';
    }
  }
  return { name, value: shown, traceback: [`Uncaught ${shown}`] };
}

/** "file:line", the source line and a caret line, as node prints them. */
function sourceContext(script, lines, line, caret) {
  if (!(line >= 1 && line <= lines.length)) return [];
  return [`${script}:${line}`, lines[line - 1], caret, ''];
}

/** A caret under `column` (1-based). */
function caretAt(column) {
  return `${' '.repeat(Math.max(0, column - 1))}^`;
}

/** Where the first frame in the script points, as [line, column]. */
function firstUserPosition(traceback, script) {
  for (const line of traceback) {
    if (!/^\s+at /.test(line) || !frameIn(line, script)) continue;
    const match = line.match(/:(\d+):(\d+)\)?$/);
    if (match) return [Number(match[1]), Number(match[2])];
  }
  return null;
}

// ------------------------------------------------------------------------------------------
// turning the script into a function body

/** Loads acorn (a dependency of Debian's nodejs) from the system's module directories. */
function loadAcorn() {
  const dirs = ['/usr/share/nodejs', '/usr/lib/nodejs', '/usr/lib/node_modules', '/usr/local/lib/node_modules'];
  for (const dir of dirs) {
    try {
      return require(path.join(dir, 'acorn'));
    } catch {
      // next
    }
  }
  return null;
}

/** The TypeScript compiler of the image (Debian's node-typescript), or null. */
function loadTypeScript() {
  for (const dir of ['/usr/share/nodejs', '/usr/lib/nodejs', '/usr/local/lib/node_modules']) {
    try {
      return require(path.join(dir, 'typescript'));
    } catch {
      // next
    }
  }
  return null;
}

const ACORN_OPTIONS = {
  ecmaVersion: 'latest',
  sourceType: 'script',
  allowAwaitOutsideFunction: true,
  allowReturnOutsideFunction: true,
  allowImportExportEverywhere: true,
  allowHashBang: true,
  locations: true,
};

/** `import.meta` becomes this expression: the same length, so columns stay. */
const IMPORT_META = '__sandq__.m';

/** Every node under `node` (ESTree: objects with a string `type`). */
function walk(node, visit) {
  if (Array.isArray(node)) {
    for (const child of node) walk(child, visit);
    return;
  }
  if (node === null || typeof node !== 'object' || typeof node.type !== 'string') return;
  visit(node);
  for (const key of Object.keys(node)) {
    if (key === 'loc') continue;
    const child = node[key];
    if (child !== null && typeof child === 'object') walk(child, visit);
  }
}

/** `text` with every character but line breaks turned into a space. */
function blank(text) {
  return text.replace(/[^\r\n\u2028\u2029]/g, ' ');
}

/**
 * The script as the body of an async function: returns `{header, body, strict}` where
 * `header` goes on a line of its own before the body (the script's line 1 stays line 1), or
 * throws acorn's SyntaxError.
 */
function transform(acorn, code) {
  const program = acorn.parse(code, ACORN_OPTIONS);
  const edits = []; // {start, end, text, order}: order sorts edits at one position
  const hoisted = [];
  let moduleSyntax = false;
  const body = program.body;
  for (const node of body) {
    if (node.type === 'ImportDeclaration') {
      moduleSyntax = true;
      hoisted.push(importStatement(node));
      edits.push({ start: node.start, end: node.end, text: blank(code.slice(node.start, node.end)), order: 2 });
    } else if (node.type === 'ExportNamedDeclaration' || node.type === 'ExportAllDeclaration') {
      moduleSyntax = true;
      if (node.declaration) {
        // `export const x = 1` -> `       const x = 1`
        edits.push({ start: node.start, end: node.declaration.start, text: blank(code.slice(node.start, node.declaration.start)), order: 2 });
      } else {
        if (node.source) hoisted.push(`await import(${node.source.raw});`);
        edits.push({ start: node.start, end: node.end, text: blank(code.slice(node.start, node.end)), order: 2 });
      }
    } else if (node.type === 'ExportDefaultDeclaration') {
      moduleSyntax = true;
      const decl = node.declaration;
      const prefix = code.slice(node.start, decl.start);
      if ((decl.type === 'FunctionDeclaration' || decl.type === 'ClassDeclaration') && decl.id) {
        edits.push({ start: node.start, end: decl.start, text: blank(prefix), order: 2 });
      } else if (decl.type === 'FunctionDeclaration' || decl.type === 'ClassDeclaration') {
        // an anonymous declaration is an expression once `export default` is gone
        edits.push({ start: node.start, end: decl.start, text: `void${blank(prefix.slice(4))}`, order: 2 });
      } else {
        edits.push({ start: node.start, end: decl.start, text: `;(${blank(prefix.slice(2))}`, order: 2 });
        edits.push({ start: decl.end, end: decl.end, text: ')', order: 0 });
      }
    }
  }
  if (code.includes('import')) {
    walk(program, (node) => {
      if (node.type === 'MetaProperty' && node.meta.name === 'import') {
        moduleSyntax = true;
        edits.push({ start: node.start, end: node.end, text: IMPORT_META, order: 2 });
      }
    });
  }
  // The directive prologue: `'use strict'` must stay first, before anything hoisted.
  let strict = moduleSyntax;
  for (const node of body) {
    if (node.type !== 'ExpressionStatement' || typeof node.directive !== 'string') break;
    if (node.directive === 'use strict') strict = true;
  }
  let header = hoisted.join(' ');
  // The last statement (trailing `;;` aside), when it is an expression, gives the result.
  let lastIndex = body.length - 1;
  while (lastIndex >= 0 && body[lastIndex].type === 'EmptyStatement') lastIndex -= 1;
  const last = body[lastIndex];
  if (last && last.type === 'ExpressionStatement' && last.directive !== 'use strict') {
    // Opened where the previous statement ends (or on the header line), so that the
    // expression's own columns stay; the gap holds only blanks and comments.
    const open = '__sandq__.set(';
    if (lastIndex > 0) {
      edits.push({ start: body[lastIndex - 1].end, end: body[lastIndex - 1].end, text: `;${open}`, order: 1 });
    } else {
      header += `;${open}`;
    }
    edits.push({ start: last.expression.end, end: last.expression.end, text: ')', order: 0 });
  }
  edits.sort((a, b) => a.start - b.start || a.order - b.order);
  let out = '';
  let at = 0;
  for (const edit of edits) {
    out += code.slice(at, edit.start) + edit.text;
    at = edit.end;
  }
  out += code.slice(at);
  return { header, body: out, strict };
}

/** The hoisted form of an `import` declaration. */
function importStatement(node) {
  const source = `await import(${node.source.raw})`;
  const names = [];
  let namespace = null;
  for (const spec of node.specifiers) {
    if (spec.type === 'ImportNamespaceSpecifier') namespace = spec.local.name;
    else if (spec.type === 'ImportDefaultSpecifier') names.push(`default: ${spec.local.name}`);
    else names.push(`${spec.imported.type === 'Literal' ? spec.imported.raw : spec.imported.name}: ${spec.local.name}`);
  }
  if (namespace !== null) {
    return names.length ? `const ${namespace} = ${source}; const {${names.join(', ')}} = ${namespace};` : `const ${namespace} = ${source};`;
  }
  return names.length ? `const {${names.join(', ')}} = ${source};` : `${source};`;
}

/** The parameters of the function the script runs as. */
const PARAMS = ['exports', 'require', 'module', '__filename', '__dirname', '__sandq__'];

/** Compiles `header` and `body` into the async function (a V8 SyntaxError is thrown). */
function compile(script, header, body, strict) {
  const source = `(async function (${PARAMS.join(', ')}) {${strict ? "'use strict'; " : ''}${header}\n${body}\n})`;
  const compiled = new vm.Script(source, {
    filename: script,
    // The header is line 0: the script's first line is line 1, as in the file.
    lineOffset: -1,
    importModuleDynamically: vm.constants.USE_MAIN_CONTEXT_DEFAULT_LOADER,
  });
  return { fn: compiled.runInThisContext(), usesImport: source.includes('import') };
}

/**
 * The first `import()` with the main context's loader prints an ExperimentalWarning: trigger
 * it here, with the warning dropped, so that the user's code prints nothing it did not ask for.
 */
function quietImportLoader() {
  const emitWarning = process.emitWarning;
  process.emitWarning = function drop(warning, ...rest) {
    if (String(warning).includes('USE_MAIN_CONTEXT_DEFAULT_LOADER')) return;
    emitWarning.call(process, warning, ...rest);
  };
  try {
    const probe = new vm.Script("import('node:path')", {
      filename: path.join(__dirname, '[sandq-probe]'),
      importModuleDynamically: vm.constants.USE_MAIN_CONTEXT_DEFAULT_LOADER,
    });
    probe.runInThisContext().catch(() => {});
  } catch {
    // only the warning is at stake
  } finally {
    process.emitWarning = emitWarning;
  }
}

/**
 * What a V8 SyntaxError from compiling says about the script: `{message, line, caret}` (the
 * caret line under the source line, as V8 marks it), or `{message}` when V8's position is
 * not in the script. An error at the wrapper's closing `})` means the script ended too soon.
 */
function v8Syntax(error, script, lines) {
  const message = safeString(error.message, 'invalid syntax');
  const stack = typeof error.stack === 'string' ? error.stack.split('\n') : [];
  const match = stack[0] && stack[0].startsWith(`${script}:`) && stack[0].match(/:(\d+)$/);
  if (!match) return { message };
  const line = Number(match[1]);
  if (line > lines.length) {
    const last = lines[lines.length - 1];
    return { message: 'Unexpected end of input', line: lines.length, caret: `${' '.repeat(last.length)}^` };
  }
  if (line < 1 || !stack[2] || !stack[2].includes('^')) return { message };
  return { message, line, caret: stack[2] };
}

// ------------------------------------------------------------------------------------------
// Warm start (`sandq_runner.js --warm`): the worker starts the sandbox before any job; the
// runner loads its parser, says it is ready and waits for the handover (as sandq_runner.py).

const WARM_SCRIPT = '/sandq/main.js';
const WARM_READY = '/sandq/out/.ready';
const WARM_GO = '/sandq/out/.go';
const WARM_HANDOVER = '/sandq/handover.json';

/**
 * Blocks until the worker hands a job over; returns the job's argv after the script. The
 * handover file (read-only for the sandbox) holds the job's whole environment, which replaces
 * the warm-up one, and its arguments.
 */
function waitForHandover() {
  fs.closeSync(fs.openSync(WARM_READY, 'w'));
  // Opening the FIFO blocks until the worker opens it to write its one byte.
  const go = fs.openSync(WARM_GO, 'r');
  fs.readSync(go, Buffer.alloc(1), 0, 1, null);
  fs.closeSync(go);
  const handover = JSON.parse(fs.readFileSync(WARM_HANDOVER, 'utf8'));
  for (const name of Object.keys(process.env)) delete process.env[name];
  Object.assign(process.env, handover.env);
  // require's search path from the job's environment (NODE_PATH, HOME), as at start-up.
  Module._initPaths();
  try {
    fs.unlinkSync(WARM_READY);
  } catch {
    // already gone
  }
  return handover.args;
}

function main() {
  let preloaded;
  if (process.argv[2] === '--warm') {
    preloaded = loadAcorn();
    const args = waitForHandover();
    process.argv.splice(2, process.argv.length - 2, WARM_SCRIPT, ...args);
  }
  const script = process.argv[2];
  if (script === undefined) {
    process.stderr.write('usage: sandq_runner.js <script> [args...]\n');
    exit(2);
  }
  const filename = path.resolve(script);
  // A job for another service's programs (`compat`) runs in its working directory (the same
  // directory as /work; docs/e2b.md).
  if (process.env.SANDQ_WORKDIR) {
    try {
      process.chdir(process.env.SANDQ_WORKDIR);
    } catch {
      // stays in /work
    }
  }
  const outputs = new Outputs(process.env.SANDQ_OUTPUTS || null, outputLimit());
  let code;
  try {
    code = fs.readFileSync(filename, 'utf8');
  } catch (e) {
    const message = `Error: Cannot find module '${filename}'`;
    process.stderr.write(`${message}\n`);
    outputs.write({ output_type: 'error', ename: 'Error', evalue: `Cannot find module '${filename}'`, traceback: [message] });
    exit(1);
  }
  if (code.charCodeAt(0) === 0xfeff) code = code.slice(1);
  // A hashbang is only valid at the very start of a script: make it a comment.
  if (code.startsWith('#!')) code = `//${code.slice(2)}`;
  // TypeScript (a job's `dialect`): its types stripped by the image's TypeScript compiler
  // (Debian's node-typescript), one file on its own, the JavaScript kept line for line.
  if (process.env.SANDQ_TYPESCRIPT) {
    const ts = loadTypeScript();
    if (ts === null) {
      process.stderr.write('TypeScript is not in this image (node-typescript)\n');
      outputs.write({ output_type: 'error', ename: 'Error', evalue: 'TypeScript is not in this image', traceback: [] });
      exit(1);
    }
    code = ts.transpileModule(code, {
      compilerOptions: { target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.ESNext, removeComments: false, isolatedModules: true },
      reportDiagnostics: false,
    }).outputText.replace(/\n?export \{\};?\s*$/, '\n');
  }
  const lines = code.split(/\r\n|\r|\n|\u2028|\u2029/);

  // The user's code sees plain `node script args...`.
  process.argv.splice(1, 1);
  const mod = new Module(filename, null);
  mod.id = '.';
  mod.filename = filename;
  mod.paths = Module._nodeModulePaths(path.dirname(filename));
  Module._cache[filename] = mod;
  process.mainModule = mod;
  const userRequire = Module.createRequire(filename);

  let reported = false;
  function fatal(error) {
    if (reported) return;
    reported = true;
    const { name, value, traceback } = describe(error, filename);
    outputs.write({ output_type: 'error', ename: name, evalue: value, traceback });
    const at = firstUserPosition(traceback, filename);
    const context = at ? sourceContext(filename, lines, at[0], caretAt(at[1])) : [];
    try {
      fs.writeSync(2, `${context.concat(traceback).join('\n')}\n\nNode.js ${process.version}\n`);
    } catch {
      // stderr is gone
    }
    exit(1);
  }
  function syntaxError({ message, line, caret }) {
    const context = line ? sourceContext(filename, lines, line, caret) : [];
    const traceback = context.concat([`SyntaxError: ${message}`]);
    outputs.write({ output_type: 'error', ename: 'SyntaxError', evalue: message, traceback });
    try {
      fs.writeSync(2, `${traceback.join('\n')}\n\nNode.js ${process.version}\n`);
    } catch {
      // stderr is gone
    }
    exit(1);
  }

  // Errors nobody handles (thrown by the script, a timer or a callback, or a rejection nobody
  // awaited) end the run as in node: reported when no `uncaughtException` listener of the
  // user's takes them.
  process.on('uncaughtExceptionMonitor', (error) => {
    if (process.listenerCount('uncaughtException') === 0 && !process.hasUncaughtExceptionCaptureCallback()) {
      fatal(error);
    }
  });

  const acorn = preloaded === undefined ? loadAcorn() : preloaded;
  let compiled;
  let parseError = null;
  let plan = null;
  if (acorn) {
    try {
      plan = transform(acorn, code);
    } catch (e) {
      parseError = e;
    }
  }
  try {
    compiled = plan ? compile(filename, plan.header, plan.body, plan.strict) : compile(filename, '', code, false);
  } catch (e) {
    const found = v8Syntax(e, filename, lines);
    if (found.line === undefined && parseError && parseError.loc) {
      // V8's position is off the script: acorn's
      found.line = parseError.loc.line;
      found.caret = caretAt(parseError.loc.column + 1);
    }
    syntaxError(found);
  }
  if (plan === null && parseError !== null) {
    // V8 took what acorn (older) could not parse: run it without the rewrites.
    note(`the script runs without notebook features (${safeString(parseError.message, 'parse error')}): no result value, no static import`);
  }
  if (compiled.usesImport) quietImportLoader();

  let result = { set: false, value: undefined };
  const sandq = {
    set(value) {
      result = { set: true, value };
    },
    m: {
      url: pathToFileURL(filename).href,
      filename,
      dirname: path.dirname(filename),
      resolve: (specifier) => {
        if (specifier.startsWith('node:')) return specifier;
        const resolved = userRequire.resolve(specifier);
        return Module.isBuiltin(resolved) ? `node:${resolved}` : pathToFileURL(resolved).href;
      },
    },
  };
  let running;
  try {
    running = compiled.fn.call(mod.exports, mod.exports, userRequire, mod, filename, path.dirname(filename), sandq);
  } catch (e) {
    // An async function does not throw; kept for safety.
    running = Promise.reject(e);
  }
  running.then(
    () => {
      mod.loaded = true;
      if (result.set && result.value !== undefined) {
        outputs.write({ output_type: 'execute_result', data: { 'text/plain': safeInspect(result.value) }, metadata: {} });
      }
    },
    (error) => {
      // Thrown again outside any promise: node's own uncaught-exception handling decides
      // (the user's `uncaughtException` listeners, else the monitor above).
      process.nextTick(() => {
        throw error;
      });
    },
  );
}

main();
