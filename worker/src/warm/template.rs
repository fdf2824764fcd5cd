//! Templates: for each SKU the worker serves, one pre-imported Python runner
//! (`sandq-container template`, [`crate::sandbox::template`]) from which the jobs of Python warm
//! sandboxes are forked ([`crate::sandbox::fork`]; design and threat analysis in
//! `docs/threat-model.md`, "Forked sandboxes"). One per SKU because the interpreter and numpy
//! read the SKU's CPU count from the environment at start-up (`PYTHON_CPU_COUNT`,
//! `OPENBLAS_NUM_THREADS`...): a template's environment is a warm sandbox's of its SKU.
//!
//! A template is ready once it has preloaded and says so; if it exits it is started again
//! after [`RESTART_DELAY`], and meanwhile warm sandboxes are made the unforked way
//! ([`super::refill`]). After `warm.template_lifetime` it is replaced by a new one (the jobs
//! forked from one template share its address-space layout and hash secret): its stdin is
//! closed, which ends it (the sandboxes already forked from it keep their processes), and a
//! new one is started at once. Templates end with the worker: their stdin is a pipe from it.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use sandq_schemas::{Runtime, Sku};
use tokio::io::AsyncBufReadExt;
use tokio::process::Command;
use tracing::{info, warn};

use crate::context::Context;

/// Wait before a template that exited is started again.
const RESTART_DELAY: Duration = Duration::from_secs(1);

/// The directory of the worker's templates: `<jobs_dir>.templates` (outside the jobs dir,
/// whose entries are job dirs).
fn templates_dir(ctx: &Context) -> PathBuf {
    let jobs = &ctx.settings.jobs_dir;
    let name = jobs.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    jobs.with_file_name(format!("{name}.templates"))
}

/// Runs a template per SKU served while Python warm sandboxes are forked, until `shutdown`.
pub(crate) async fn serve(ctx: Context, shutdown: tokio::sync::watch::Receiver<bool>) {
    let settings = &ctx.settings;
    if !settings.warm.forked || settings.warm.per_sku == 0 || !settings.warm.runtimes.contains(&Runtime::Python) {
        return;
    }
    let dir = templates_dir(&ctx);
    let _ = std::fs::remove_dir_all(&dir);
    let runner = dir.join("runner");
    // The Python user site exists when the interpreter starts, as in every job dir
    // (crate::jobdir): Python puts it on sys.path only then, and a forked job's packages
    // (restored for its session, or installed by it) are there, at the same path.
    let user_site = runner.join(crate::layout::PACKAGES_MOUNT_POINT).join("python").join(&settings.packages.python_site);
    let written = std::fs::create_dir_all(runner.join("sandq_nb")).and_then(|()| std::fs::create_dir_all(&user_site)).and_then(|()| {
        crate::layout::runner_files(Runtime::Python).iter().try_for_each(|(name, text)| std::fs::write(runner.join(name), text))
    });
    if let Err(e) = written {
        warn!(dir = %dir.display(), error = %e, "cannot write the templates' runner: warm sandboxes start unforked");
        return;
    }
    let mut tasks = Vec::new();
    for sku in settings.skus.keys().copied() {
        ctx.warm.templates.set_starting(sku, true);
        tasks.push(tokio::spawn(keep(ctx.clone(), sku, dir.clone(), shutdown.clone())));
    }
    for task in tasks {
        let _ = task.await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Keeps `sku`'s template running until `shutdown`.
async fn keep(ctx: Context, sku: Sku, dir: PathBuf, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    let settings = &ctx.settings;
    let root = dir.join(format!("root-{sku}"));
    let socket = dir.join(format!("{sku}.sock"));
    loop {
        if *shutdown.borrow() {
            return;
        }
        let Some(sku_settings) = settings.skus.get(&sku) else { return };
        let mut env =
            crate::run::sandbox_environment(&settings.packages, sku, &sku_settings.limits, Some(settings.outputs.max_outputs_bytes));
        env.push(format!("SANDQ_PRELOAD={}", settings.warm.preload));
        let _ = std::fs::create_dir_all(&root);
        let spawned = Command::new(&settings.container_helper)
            .arg("template")
            .arg(&settings.rootfs)
            .arg(dir.join("runner"))
            .arg(&root)
            .arg(&socket)
            .env_clear()
            .envs(env.iter().filter_map(|e| e.split_once('=')))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                ctx.warm.templates.set_starting(sku, false);
                warn!(%sku, error = %e, "cannot start the template");
                tokio::time::sleep(RESTART_DELAY * 5).await;
                continue;
            }
        };
        let t0 = std::time::Instant::now();
        // Held open for the template's life: closing it ends the template.
        let stdin = child.stdin.take();
        let mut lines = child.stdout.take().map(|s| tokio::io::BufReader::new(s).lines());
        // Set once it is ready: when it is replaced.
        let mut retire_at = None;
        let ended = loop {
            tokio::select! {
                line = async { match lines.as_mut() { Some(l) => l.next_line().await, None => std::future::pending().await } } => {
                    match line {
                        Ok(Some(l)) if l == "ready" => {
                            info!(%sku, ms = t0.elapsed().as_millis() as u64, pid = child.id(), "template ready");
                            ctx.warm.templates.set(sku, Some(socket.clone()));
                            ctx.warm.templates.set_starting(sku, false);
                            retire_at = tokio::time::Instant::now().checked_add(settings.warm.template_lifetime);
                        }
                        Ok(Some(_)) => {}
                        _ => lines = None,
                    }
                }
                status = child.wait() => break Ended::Exited(status),
                () = async { match retire_at { Some(at) => tokio::time::sleep_until(at).await, None => std::future::pending().await } } => break Ended::Retired,
                _ = shutdown.changed() => break Ended::Shutdown,
            }
        };
        ctx.warm.templates.set(sku, None);
        // A template that ended (or never started) is no longer waited for.
        ctx.warm.templates.set_starting(sku, false);
        match ended {
            Ended::Shutdown => {
                let _ = child.kill().await;
                return;
            }
            Ended::Exited(status) => {
                warn!(%sku, status = ?status.ok(), "the template exited; starting it again");
                tokio::time::sleep(RESTART_DELAY).await;
            }
            Ended::Retired => {
                // Its stdin closed, it ends (after the fork it may be serving); the next one
                // starts now, and the SKU's Python warm sandboxes wait for it meanwhile.
                ctx.warm.templates.set_starting(sku, true);
                drop(stdin);
                if tokio::time::timeout(RETIRE_WAIT, child.wait()).await.is_err() {
                    let _ = child.kill().await;
                }
                info!(%sku, "template replaced after warm.template_lifetime");
            }
        }
    }
}

/// How a template's run ended.
enum Ended {
    /// The worker shuts down.
    Shutdown,
    /// It exited (or could not be waited for).
    Exited(std::io::Result<std::process::ExitStatus>),
    /// It served `warm.template_lifetime`.
    Retired,
}

/// Longest a retired template is given to end before it is killed.
const RETIRE_WAIT: Duration = Duration::from_secs(5);
