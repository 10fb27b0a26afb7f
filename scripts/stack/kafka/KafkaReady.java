// Readiness probe for the local Kafka broker, run by scripts/stack/up.sh with
// Java's single-file source launcher on the broker's own classpath:
//   java -cp '<kafka libs>/*' KafkaReady.java 127.0.0.1:59092 90
// Succeeds (exit 0) once the broker answers a metadata request (describeCluster
// returns a controller and at least one node); exit 1 when the deadline passes.
import java.util.Properties;
import java.util.concurrent.TimeUnit;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.clients.admin.DescribeClusterResult;

public class KafkaReady {
    public static void main(String[] args) throws Exception {
        String bootstrap = args[0];
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(Long.parseLong(args[1]));
        Properties props = new Properties();
        props.put(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        props.put(AdminClientConfig.REQUEST_TIMEOUT_MS_CONFIG, 3000);
        props.put(AdminClientConfig.DEFAULT_API_TIMEOUT_MS_CONFIG, 3000);
        props.put(AdminClientConfig.RECONNECT_BACKOFF_MS_CONFIG, 200);
        props.put(AdminClientConfig.RECONNECT_BACKOFF_MAX_MS_CONFIG, 500);
        String last = "no answer";
        try (Admin admin = Admin.create(props)) {
            while (System.nanoTime() < deadline) {
                try {
                    DescribeClusterResult r = admin.describeCluster();
                    int nodes = r.nodes().get(3, TimeUnit.SECONDS).size();
                    if (nodes > 0 && r.controller().get(3, TimeUnit.SECONDS) != null) {
                        System.out.println("kafka ready: " + nodes + " node(s), cluster "
                                + r.clusterId().get(3, TimeUnit.SECONDS));
                        return;
                    }
                    last = "no nodes in metadata yet";
                } catch (Exception e) {
                    last = e.toString();
                }
                Thread.sleep(300);
            }
        }
        System.err.println("kafka not ready at " + bootstrap + ": " + last);
        System.exit(1);
    }
}
