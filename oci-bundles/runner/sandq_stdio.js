'use strict';
// sandq: preloaded into every Node.js job (`node --require /sandq/sandq_stdio.js ...`, script
// and notebook mode) so that nothing written to stdout or stderr is lost.
//
// On Linux, node writes to a pipe asynchronously once the pipe is full: the rest waits in
// libuv's queue, and `process.exit()` (or a kill) drops it (a script that logged 300,000 bytes
// and called process.exit(0) delivered 131,072). Blocking writes make each `write` return only
// once the kernel has the bytes, as for a file or a terminal. The cost: a program that writes
// faster than the worker drains waits, which is the worker's intent anyway (run.rs).
for (const stream of [process.stdout, process.stderr]) {
  const handle = stream && stream._handle;
  if (handle && typeof handle.setBlocking === 'function') {
    handle.setBlocking(true);
  }
}
