//! Serving: connections accepted, each bounded in how long its headers may take, until
//! shutdown, then a grace period for the requests under way.

use std::time::Duration;

use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Serves `router` on `listener` until `shutdown` turns true, then lets requests under way
/// finish (at most `grace`). Each connection's headers must arrive within `read_timeout`
/// (hyper's `header_read_timeout`), so slow headers cannot hold connections open.
pub async fn serve(listener: TcpListener, router: Router, read_timeout: Duration, mut shutdown: watch::Receiver<bool>, grace: Duration) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            // The guard `wait_for` returns is dropped inside: the loop's future stays `Send`
            // (main.rs spawns one for the operator's listener).
            () = async { let _ = shutdown.wait_for(|stop| *stop).await; } => break,
        };
        let _ = stream.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(read_timeout)
            .serve_connection(TokioIo::new(stream), service);
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    if tokio::time::timeout(grace, graceful.shutdown()).await.is_err() {
        tracing::warn!("requests still under way at the end of the grace period were cut off");
    }
}
