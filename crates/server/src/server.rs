//! Binding, serving and graceful shutdown.

use std::future::{Future, IntoFuture};
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;

use crate::routes::router;
use crate::state::{AppState, ServerConfig};
use runtime::Runtime;

/// A bound server, ready to serve.
#[derive(Debug)]
pub struct Server {
    listener: TcpListener,
    state: Arc<AppState>,
}

impl Server {
    /// Binds `addr` (port 0 picks a free port) for `model`.
    pub async fn bind(
        addr: SocketAddr,
        model: Arc<Runtime>,
        config: ServerConfig,
    ) -> std::io::Result<Server> {
        let listener = TcpListener::bind(addr).await?;
        Ok(Server {
            listener,
            state: Arc::new(AppState::new(model, config)),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The shared state (metrics, the model).
    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    /// Serves until `shutdown` completes; then stops accepting, lets in-flight requests
    /// finish for up to [`ServerConfig::shutdown_grace`], and cancels the rest (dropping
    /// their streams cancels their sequences).
    pub async fn serve(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let grace = self.state.config.shutdown_grace;
        let app = router(Arc::clone(&self.state));
        let (tx, rx) = tokio::sync::watch::channel(false);
        let mut rx_grace = rx.clone();
        tokio::spawn(async move {
            shutdown.await;
            tracing::info!("shutting down: no new connections; finishing in-flight requests");
            let _ = tx.send(true);
        });
        let mut rx_graceful = rx;
        let graceful = axum::serve(self.listener, app)
            .with_graceful_shutdown(async move {
                let _ = rx_graceful.wait_for(|v| *v).await;
            })
            .into_future();
        tokio::select! {
            r = graceful => r,
            _ = async move {
                if rx_grace.wait_for(|v| *v).await.is_err() {
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep(grace).await;
            } => {
                tracing::warn!("shutdown grace period over: cancelling in-flight requests");
                Ok(())
            }
        }
    }
}

/// Completes on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Serves `model` on `addr` until Ctrl-C or SIGTERM, on a runtime of its own (for callers
/// without one, such as the `lockstep serve` command). `on_bound` gets the bound address.
pub fn serve_blocking(
    addr: SocketAddr,
    model: Arc<Runtime>,
    config: ServerConfig,
    on_bound: impl FnOnce(SocketAddr),
) -> std::io::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("lockstep-http")
        .build()?;
    runtime.block_on(async move {
        let server = Server::bind(addr, model, config).await?;
        on_bound(server.local_addr()?);
        server.serve(shutdown_signal()).await
    })
}

/// A server on a thread (and tokio runtime) of its own, for callers without a runtime that
/// need to stop it themselves (benchmarks, embedding). Stops gracefully on
/// [`BackgroundServer::shutdown`] or drop.
#[derive(Debug)]
pub struct BackgroundServer {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl BackgroundServer {
    /// Binds `addr` (port 0 picks a free port) and starts serving `model`.
    pub fn start(
        addr: SocketAddr,
        model: Arc<Runtime>,
        config: ServerConfig,
    ) -> std::io::Result<BackgroundServer> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("lockstep-http")
            .build()?;
        let server = runtime.block_on(Server::bind(addr, model, config))?;
        let addr = server.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("lockstep-serve".into())
            .spawn(move || {
                runtime.block_on(server.serve(async move {
                    let _ = stopped.await;
                }))
            })?;
        Ok(BackgroundServer {
            addr,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets in-flight requests finish (within the grace period) and waits
    /// for the server thread.
    pub fn shutdown(mut self) -> std::io::Result<()> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> std::io::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.thread.take().map(std::thread::JoinHandle::join) {
            None => Ok(()),
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(std::io::Error::other("the server thread panicked")),
        }
    }
}

impl Drop for BackgroundServer {
    fn drop(&mut self) {
        let _ = self.stop_and_join();
    }
}
