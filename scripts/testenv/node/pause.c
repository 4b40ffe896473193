/* The pod sandbox process of the testenv's real node: sleeps until SIGINT/SIGTERM and reaps
 * zombies (it is PID 1 of the pod). Built statically by images.sh; no registry needed. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void quit(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, NULL, WNOHANG) > 0) {} }

int main(void) {
  struct sigaction a = {0};
  a.sa_handler = quit;
  sigaction(SIGINT, &a, NULL);
  sigaction(SIGTERM, &a, NULL);
  a.sa_handler = reap;
  a.sa_flags = SA_NOCLDSTOP;
  sigaction(SIGCHLD, &a, NULL);
  for (;;) pause();
}
