//! `sandq-container`: the single-threaded helper that runs one container with libcontainer
//! (see `sandq_worker::sandbox`). Exec'd by the worker, one process per container.

fn main() {
    std::process::exit(sandq_worker::sandbox::helper::main());
}
